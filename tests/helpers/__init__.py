"""Helpers the tests share: tiny Hugging Face models, grading runs, servers and notebooks started and
stopped, the engine driven step by step. Imported as ``helpers.<module>``."""
