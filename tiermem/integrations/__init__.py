"""Glue for training loops tiermem does not own (Hugging Face Trainer and Accelerate)."""
