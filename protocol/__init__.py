"""The kvd wire protocol (issue-13a fills this package); a leaf: it imports no other kvd package."""
