"""The router deploys with ``pip install 'splitserve[router]'``: all of it imports, and so does
the command line, with no other package (torch, numba, matplotlib...) installed."""

from __future__ import annotations

from torchless import ENGINE_MODULES, run_with_extras

IMPORT_ALL = """
import pkgutil, splitserve.router as r
for m in pkgutil.walk_packages(r.__path__, "splitserve.router."):
    __import__(m.name)
from splitserve.cli import build_parser
args = build_parser().parse_args(["router", "--decode", "http://127.0.0.1:9"])
from splitserve.router.cli import config_from_args
from splitserve.router.app import create_app
create_app(config_from_args(args))
"""


def test_the_router_runs_on_its_extra_alone():
    blocked = run_with_extras(["router"], IMPORT_ALL, timeout=60)
    assert set(ENGINE_MODULES) <= blocked


GENERATE = """
import contextlib, io
from splitserve.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    assert main(["generate", "--prompt", "hi"]) == 2
assert "needs torch" in err.getvalue() and "splitserve[engine]" in err.getvalue(), err.getvalue()
"""


def test_an_engine_command_on_the_router_extra_says_which_extra_it_needs():
    run_with_extras(["router"], GENERATE, timeout=60)
