"""The services a run talks to: probing whether one answers, and waiting out one that stops answering mid-run."""
