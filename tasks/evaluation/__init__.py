"""The evaluate stage's task, the models it compares wherever they are, and human evaluation's Prefect side."""
