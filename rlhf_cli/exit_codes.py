"""Exit statuses of the `rlhf` command beyond success (0).

1 is an error (rlhf_cli/main.py) and 2 a usage error (typer). A refusal that is the documented answer
(`rlhf promote`: the gate rejects the challenger, or there is nothing to roll back; `rlhf eval`: A and B
are the same model) has a status of its own, so a script can tell it from a failure.
"""

REFUSED_EXIT_CODE = 3
