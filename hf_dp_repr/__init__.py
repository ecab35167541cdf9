"""hf-dp-repr: differentially private fine-tuning of Hugging Face models, and what DP noise does to their representations."""

__version__ = "0.1.0"
