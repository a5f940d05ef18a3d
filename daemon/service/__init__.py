"""Service life: start-up checks, the data-dir lock, the log, backups, detaching and stopping, `kvd status`,
`kvd service install`, and the BLAS interposed under MLX's CPU backend.
"""
