"""What the site serves around the API for people with a browser: the OpenAPI 3.0 copy of the schema
that /docs renders, and /favicon.ico.

    add_site_routes(app)   # done by create_app (routes.py)

/docs is Swagger UI from the pip-packaged bundle (swagger-ui-bundle, so it works offline), whose
Swagger UI (4.15) renders OpenAPI 3.0 documents only and refuses FastAPI's 3.1 one ("does not specify a
valid version field"). `/openapi.json` stays 3.1 for tools; the page reads `DOCS_OPENAPI_URL`, the same
schema written in OpenAPI 3.0 terms by `openapi_30` (nullable for a null member of a union, enum for
const, boolean exclusive bounds, one example).
"""

from __future__ import annotations

import copy
import functools
import io
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

DOCS_OPENAPI_URL = "/docs/openapi.json"  # what the /docs page loads
OPENAPI_30 = "3.0.3"


def add_site_routes(app: FastAPI) -> None:
    """/docs's 3.0 document (the page is pointed at it) and /favicon.ico."""

    async def docs_openapi() -> JSONResponse:
        return JSONResponse(openapi_30(app.openapi()))

    app.add_api_route(DOCS_OPENAPI_URL, docs_openapi, methods=["GET"], include_in_schema=False)

    async def favicon() -> Response:
        return Response(favicon_ico(), media_type="image/x-icon", headers={"Cache-Control": "public, max-age=86400"})

    app.add_api_route("/favicon.ico", favicon, methods=["GET"], include_in_schema=False)


# ------------------------------------------------------------------------------------------ OpenAPI 3.1 -> 3.0


def openapi_30(doc: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI 3.1 document (FastAPI's) as OpenAPI 3.0: every schema rewritten by `schema_30`."""
    out = copy.deepcopy(doc)
    out["openapi"] = OPENAPI_30
    for name, schema in out.get("components", {}).get("schemas", {}).items():
        out["components"]["schemas"][name] = schema_30(schema)
    for item in out.get("paths", {}).values():
        for op in item.values():
            if not isinstance(op, dict):
                continue
            for param in op.get("parameters", []):
                if "schema" in param:
                    param["schema"] = schema_30(param["schema"])
            bodies = [op.get("requestBody", {})] + list(op.get("responses", {}).values())
            for body in bodies:
                for media in body.get("content", {}).values():
                    if "schema" in media:
                        media["schema"] = schema_30(media["schema"])
    return out


_NESTED_ONE = ("items", "not", "additionalProperties")
_NESTED_LIST = ("anyOf", "oneOf", "allOf")


def schema_30(schema: Any) -> Any:
    """One JSON Schema (2020-12, as OpenAPI 3.1 has it) -> an OpenAPI 3.0 Schema Object."""
    if not isinstance(schema, dict):
        return schema
    s = dict(schema)
    for key in _NESTED_ONE:
        if isinstance(s.get(key), dict):
            s[key] = schema_30(s[key])
    if isinstance(s.get("properties"), dict):
        s["properties"] = {name: schema_30(sub) for name, sub in s["properties"].items()}
    for key in _NESTED_LIST:
        if key in s:
            s[key] = [schema_30(sub) for sub in s[key]]
    if isinstance(s.get("type"), list):  # {"type": ["string", "null"]}
        kinds = [t for t in s["type"] if t != "null"]
        if len(kinds) < len(s["type"]):
            s["nullable"] = True
        if len(kinds) == 1:
            s["type"] = kinds[0]
        else:
            del s["type"]
            s.setdefault("anyOf", []).extend({"type": t} for t in kinds)
    for key in ("anyOf", "oneOf"):  # a null member -> nullable
        members = s.get(key)
        if members and any(m == {"type": "null"} for m in members):
            rest = [m for m in members if m != {"type": "null"}]
            s["nullable"] = True
            if len(rest) == 1:
                del s[key]
                only = rest[0]
                if "$ref" in only:  # a $ref's siblings are ignored in 3.0
                    s["allOf"] = [only]
                else:
                    s = {**only, **s}
            elif rest:
                s[key] = rest
            else:
                del s[key]
    if "const" in s:
        s["enum"] = [s.pop("const")]
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = s.get(bound)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            s[inclusive] = value
            s[bound] = True
    if isinstance(s.get("examples"), list):
        examples = s.pop("examples")
        if examples:
            s["example"] = examples[0]
    return s


# ------------------------------------------------------------------------------------------ favicon


@functools.cache
def favicon_ico() -> bytes:
    """A 32 x 32 icon drawn here (no file to ship): two chevrons, a speculative step ahead of the
    committed one, on the demo's green."""
    from PIL import Image, ImageDraw

    size = 32
    im = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(im)
    draw.rounded_rectangle((0, 0, size - 1, size - 1), radius=7, fill=(22, 163, 74, 255))
    draw.polygon([(5, 8), (15, 16), (5, 24)], fill=(255, 255, 255, 255))
    draw.polygon([(15, 8), (25, 16), (15, 24)], fill=(187, 247, 208, 255))
    buf = io.BytesIO()
    im.save(buf, format="ICO", sizes=[(16, 16), (32, 32)])
    return buf.getvalue()
