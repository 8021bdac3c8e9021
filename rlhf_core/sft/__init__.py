"""Supervised fine-tuning (paper section 4.1): batches of prompt + reply with the loss on the reply only."""
