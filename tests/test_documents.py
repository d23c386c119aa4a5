"""attnres.documents: spec and platform documents through one converter."""

from __future__ import annotations

import json

import attrs

from attnres.backends import BackendSpec, registered_backends
from attnres.documents import platform_document, spec_document
from attnres.platform import Platform


def test_every_spec_field_is_in_its_document_and_it_is_json() -> None:
    for spec in registered_backends():
        doc = spec_document(spec)
        assert {a.name for a in attrs.fields(BackendSpec)} <= set(doc)
        assert doc["kind"] == ("sparse" if spec.sparse else "dense")
        assert doc["kernel_source"] in ("builtin", "registered", "none")
        json.dumps(doc)  # plain JSON data
    fa = spec_document(next(s for s in registered_backends() if s.name == "fa"))
    assert fa["platforms"] == ["cuda", "rocm"]  # vocabulary order, not alphabetical
    assert fa["dtypes"] == ["float16", "bfloat16"]
    assert fa["capabilities"]["cuda"]["description"] == ">= sm80"
    assert fa["kernel"] == "attnres.kernels.fa:make_kernel"


def test_platform_document_has_every_fact_and_a_description() -> None:
    platform = Platform.simulate("cuda:sm90+flash_attn")
    doc = platform_document(platform)
    assert {a.name for a in attrs.fields(Platform)} <= set(doc)
    assert doc["capability"] == [9, 0]
    assert doc["description"] == platform.describe()
    flash = next(p for p in doc["packages"] if p["name"] == "flash_attn")
    assert flash["status"] == "present"
    json.dumps(doc)
