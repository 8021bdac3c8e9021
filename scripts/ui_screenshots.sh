#!/usr/bin/env bash
# Regenerate the user guide's pictures of the web UIs (docs/ui.md) from a real browser session:
# run the UI tests (tests/team/test_ui_*.py) against the team stack they start, then copy the key
# screenshots into docs/figures/ui/. Needs what the UI tests need: the dev extras and Debian's
# `chromium` (or RLHF_CHROMIUM naming a Chromium binary). About 5 minutes on 2 CPU cores.
#
#   scripts/ui_screenshots.sh
#
# Every screenshot the tests take (one per step) stays in test-output/ui-screenshots/.
set -euo pipefail
cd "$(dirname "$0")/.."

KEY_SCREENSHOTS=(
    prefect-run-form
    prefect-run-completed
    prefect-evaluation-report
    prefect-retrain-schedule
    prefect-human-eval-form
    prefect-promotion-rejected
    mlflow-nested-runs
    mlflow-registry
)
export RLHF_UI_SCREENSHOTS="${RLHF_UI_SCREENSHOTS:-test-output/ui-screenshots}"
# A missing browser fails instead of skipping: a picture that is not taken must not go unnoticed.
CI=true python3 -m pytest -q tests/team/test_ui_*.py

mkdir -p docs/figures/ui
for name in "${KEY_SCREENSHOTS[@]}"; do
    cp "$RLHF_UI_SCREENSHOTS/$name.png" "docs/figures/ui/$name.png"
done
echo "docs/figures/ui/: ${#KEY_SCREENSHOTS[@]} screenshots from $RLHF_UI_SCREENSHOTS"
