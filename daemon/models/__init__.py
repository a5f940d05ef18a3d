"""Model sources: from the `model` setting to a directory mlx-lm can load.

sources (resolve a setting), builtin* and smollm2 (the built-in models), gguf* (reading and converting GGUF
files), modeldir (publishing a converted directory atomically).
"""
