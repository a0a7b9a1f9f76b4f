"""Engine adapters (vLLM, SGLang). Each imports its engine lazily, inside functions."""
