import subprocess
import sys


def test_import_service_never_imports_torch() -> None:
    code = (
        "import sys, service, service.server, service.tools.client, service.scheduling.batching,"
        " service.scheduling.continuous, service.cli, service.tools.bench;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_aiohttp_is_imported_by_the_http_module_only() -> None:
    """The HTTP/REST front end is one module; `--http-port -1` serves without importing aiohttp."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "service"
    imports = re.compile(r"^\s*(import|from) aiohttp\b", re.MULTILINE)
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if imports.search(p.read_text()))
    # text_api.py holds the OpenAI- and TEI-shaped routes, and only rest_api.py imports it
    assert users == ["frontends/rest_api.py", "frontends/text_api.py"], users
    code = "import sys, service.server, service.cli; print('aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
