"""Pieces several engines share: a managed server process and its HTTP calls, the end-of-generation
rule, llama.cpp's offload log, the chat template renderer. Not engines themselves (the registry
only looks at the modules one level up); they import nothing of the harness above `core`.
"""
