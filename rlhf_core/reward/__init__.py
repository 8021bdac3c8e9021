"""Reward-model training (paper section 4.2): pair batches, the eq. (2) loss, accuracy and its figure."""
