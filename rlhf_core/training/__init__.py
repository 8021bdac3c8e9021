"""The shared, exactly-resumable training loop used by the SFT and reward-model stages."""
