"""The API process of `kvgate serve` gets to its engine process without torch or transformers.

Both take seconds to import; the engine process needs them to load the model, the API process
only for its tokenizer, which it loads while the engine process starts (engine/backends.py). An
import of either on the way there adds its seconds to every server start, so this guards the
path `app.cli` takes up to spawning the engine, in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys

from tests.app.conftest import ROOT

_SERVE_PATH = """
import sys
from app import cli
from app.logging import configure_logging
from app.settings import load_settings, log_settings_warnings
from engine.model_source import check_model_source
from app.main import create_app
from engine.backends import ProcessBackend, engine_process_main
from engine.outputs import SeqOutput
from cache.tiers import factory

configure_logging("info")
settings = load_settings(None, {"model.path": "tiny", "cache.disk.capacity_mb": 0})
settings.tenant_registry()
log_settings_warnings(settings)
factory.validate("disk", {"path": "/tmp/x", "codec": "int8"})
factory.validate("remote", {"url": "redis://127.0.0.1:1"})
create_app(settings)
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print(",".join(heavy))
"""


def test_the_serve_path_up_to_the_engine_process_imports_no_torch_or_transformers() -> None:
    result = subprocess.run([sys.executable, "-c", _SERVE_PATH], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    heavy = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert "torch" not in heavy and "transformers" not in heavy, (
        f"the API process imported {heavy} before its engine process started; import it lazily "
        f"(where the engine runs) or move what the API process needs into a module without it")
