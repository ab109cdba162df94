#!/usr/bin/env bash
# Every run behind docs/kl-regularization.md: four sweeps on the embedded task (2 processes at a time,
# one thread each), then the figures and tables of the doc. About 30 min on 2 free cores.
# Finished runs are skipped, so re-running after an interruption continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
for s in beta estimators controllers drgrpo seeds; do
  tether sweep "scripts/sweeps/$s.yaml"
done
python scripts/kl_figures.py
