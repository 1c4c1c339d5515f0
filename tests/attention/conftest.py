"""The attention tests share one document-causal oracle (test_backends.oracle): their folder is importable."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
