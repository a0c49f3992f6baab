"""What happens to the target's logits between the model and the sampler or the accept: per-request
penalties and bias (`penalties.py`) and the logprobs reported to clients (`logprobs.py`)."""
