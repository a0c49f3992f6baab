import os
import sys

# Make tests/fake_runner.py importable as `fake_runner` however pytest is invoked.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
