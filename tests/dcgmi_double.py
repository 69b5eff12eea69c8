#!/usr/bin/env python3
"""A stand-in for NVIDIA's `dcgmi` (no DCGM here): `diag -r 1 -j` prints the JSON document named by
FAKE_DCGMI_JSON, exits with FAKE_DCGMI_RC, or sleeps FAKE_DCGMI_SLEEP seconds first (a wedged engine)."""
import os
import sys
import time

if sys.argv[1:4] != ["diag", "-r", "1"]:
    sys.exit(f"dcgmi double: unsupported arguments {sys.argv[1:]}")
time.sleep(float(os.environ.get("FAKE_DCGMI_SLEEP", "0")))
path = os.environ.get("FAKE_DCGMI_JSON")
if path:
    sys.stdout.write(open(path).read())
else:
    sys.stderr.write("Error: unable to establish a connection to the specified host: localhost\n")
sys.exit(int(os.environ.get("FAKE_DCGMI_RC", "0")))
