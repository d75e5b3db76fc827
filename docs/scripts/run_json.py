#!/usr/bin/env python3
"""Runs benchmark commands and appends {tag, cmd, report} JSON lines to an output file.

Usage: run_json.py OUT.jsonl PLAN.json, where PLAN is a JSON list of [tag, [argv...]]; each
command gets --json appended."""
import json, subprocess, sys
out = sys.argv[1]
plan = json.load(open(sys.argv[2]))
with open(out, 'a') as f:
    for tag, cmd in plan:
        r = subprocess.run(cmd + ['--json'], capture_output=True, text=True)
        try:
            rep = json.loads(r.stdout)
        except Exception:
            rep = {'error': r.stderr[-2000:], 'rc': r.returncode}
        f.write(json.dumps({'tag': tag, 'cmd': ' '.join(cmd), 'report': rep}) + '\n')
        f.flush()
