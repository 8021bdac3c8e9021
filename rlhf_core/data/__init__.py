"""Preference-data preparation: read, parse, validate, deduplicate and split human preference pairs."""
