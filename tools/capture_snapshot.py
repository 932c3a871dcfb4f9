"""Capture this machine's facts as a snapshot JSON (topology + host + versions)."""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from torchplace.hardware.topology import read_topology  # noqa: E402
print(json.dumps(read_topology().to_dict(), indent=1))
