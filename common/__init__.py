"""Facts and helpers every kvd package may import (the leaf of the import graph, standard library only):
the durable write, the token-id blob codec, the migration runner.
"""
