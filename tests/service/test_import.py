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
    server = [p for p in root.rglob("*.py") if "tools" not in p.relative_to(root).parts]  # the tools are clients
    users = sorted(str(p.relative_to(root)) for p in server if imports.search(p.read_text()))
    # the OpenAI-, TEI- and Triton-shaped routes of text and generating models: only rest_api.py imports them
    routes = ["frontends/completions_api.py", "frontends/text_api.py", "frontends/triton_generate.py"]
    assert users == sorted(["frontends/rest_api.py", *routes]), users
    code = "import sys, service.server, service.cli; print('aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
