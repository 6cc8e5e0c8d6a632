"""Validate the custom resources in rendered manifests: the Prometheus operator's and KEDA's.

kubernetes-validate only warns about custom resources, so ServiceMonitor, PodMonitor and
PrometheusRule are checked against the typed models of ``cloudcoil-models-prometheus-operator``, and
KEDA's ScaledObject against ``cloudcoil-models-keda``.
Those models drop unknown keys silently, so each document is also compared with its
validated round trip: a key that did not survive is reported as an unknown field.

    kubectl kustomize deploy/k8s/overlays/cpu > /tmp/cpu.yaml
    python deploy/k8s/crdcheck.py /tmp/cpu.yaml        # exit 1 on any problem
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import yaml

__all__ = ["check_documents", "unknown_fields"]

API_VERSIONS = ("monitoring.coreos.com/v1", "keda.sh/v1alpha1")


def _models() -> dict[tuple[str, str], Any]:
    try:
        from cloudcoil.models.keda import v1alpha1
        from cloudcoil.models.prometheus_operator import v1
    except ImportError as e:  # pragma: no cover - reported to the user
        raise SystemExit(
            f"crdcheck needs cloudcoil-models-prometheus-operator and cloudcoil-models-keda: pip install them ({e})"
        ) from e
    monitoring, keda = API_VERSIONS
    return {
        (monitoring, "ServiceMonitor"): v1.ServiceMonitor,
        (monitoring, "PodMonitor"): v1.PodMonitor,
        (monitoring, "PrometheusRule"): v1.PrometheusRule,
        (keda, "ScaledObject"): v1alpha1.ScaledObject,
    }


def unknown_fields(given: Any, kept: Any, path: str = "$") -> Iterator[str]:
    """Paths present in ``given`` but missing from the model's dump ``kept``."""
    if isinstance(given, dict) and isinstance(kept, dict):
        for key, value in given.items():
            if key not in kept:
                yield f"{path}.{key}: unknown field"
            else:
                yield from unknown_fields(value, kept[key], f"{path}.{key}")
    elif isinstance(given, list) and isinstance(kept, list):
        for i, (a, b) in enumerate(zip(given, kept, strict=False)):
            yield from unknown_fields(a, b, f"{path}[{i}]")


def check_documents(docs: list[Any]) -> list[tuple[str, list[str]]]:
    """(kind/name, problems) for every document of one of API_VERSIONS."""
    models = _models()
    results: list[tuple[str, list[str]]] = []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("apiVersion") not in API_VERSIONS:
            continue
        name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        model = models.get((doc["apiVersion"], doc.get("kind", "")))
        if model is None:
            results.append((name, [f"no model for kind {doc.get('kind')!r}"]))
            continue
        try:
            obj = model.model_validate(doc)
        except Exception as e:  # pydantic.ValidationError and friends
            results.append((name, [str(e)]))
            continue
        dumped = obj.model_dump(mode="json", by_alias=True, exclude_unset=True)
        results.append((name, list(unknown_fields(doc, dumped))))
    return results


def main(paths: list[str]) -> int:
    rc = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            docs = list(yaml.safe_load_all(f))
        results = check_documents(docs)
        if not results:
            print(f"FAIL {path}: no {' or '.join(API_VERSIONS)} resources found")
            rc = 1
        for name, problems in results:
            print("FAIL" if problems else "ok", name, *problems)
            rc |= bool(problems)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
