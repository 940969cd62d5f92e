"""Offline, strict validation of the custom resources deploy/ ships, which kubernetes-validate has no
schemas for (it only warns): GAIE's InferencePool, Gateway API's HTTPRoute, prometheus-operator's
ServiceMonitor, PodMonitor and PrometheusRule.

    .venv-deploy/bin/python tests/deploy/custom_resources.py RENDERED.yaml   # exit 1 naming each error

Each schema below is written here from the API's published Go types (named per kind, with the
release), for the fields those types define at the levels our manifests use: types, required fields,
enums, patterns, bounds, and every object closed (`additionalProperties: false`), as an API server's
strict field validation rejects an unknown field. A field the API has but a schema here lacks is
refused too: add it from the same source when a manifest needs it. Standalone (runs in .venv-deploy,
which has jsonschema and PyYAML, not kvroute).
"""

from __future__ import annotations

import sys
from typing import Any

Schema = dict[str, Any]


def obj(properties: dict[str, Schema], required: tuple[str, ...] = (), **extra: Any) -> Schema:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False, **extra}


def string(
    pattern: str | None = None, min_length: int | None = None, max_length: int | None = None, enum: tuple[str, ...] | None = None
) -> Schema:
    schema: Schema = {"type": "string"}
    for key, value in (("pattern", pattern), ("minLength", min_length), ("maxLength", max_length)):
        if value is not None:
            schema[key] = value
    if enum is not None:
        schema["enum"] = list(enum)
    return schema


def array(items: Schema, min_items: int | None = None, max_items: int | None = None, **extra: Any) -> Schema:
    schema: Schema = {"type": "array", "items": items, **extra}
    if min_items is not None:
        schema["minItems"] = min_items
    if max_items is not None:
        schema["maxItems"] = max_items
    return schema


def string_map(key: Schema | None = None, value: Schema | None = None, **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "additionalProperties": value or {"type": "string"}, **extra}
    if key is not None:
        schema["propertyNames"] = key
    return schema


def integer(minimum: int | None = None, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def resource(api_version: str, kind: str, spec: Schema) -> Schema:
    """A namespaced object: the ObjectMeta fields a manifest sets, and its spec (required)."""
    metadata = obj(
        {
            "name": string(min_length=1, max_length=253),
            "namespace": string(),
            "labels": string_map(),
            "annotations": string_map(),
        },
        ("name",),
    )
    return obj(
        {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": metadata, "spec": spec},
        ("apiVersion", "kind", "metadata", "spec"),
    )


# Kubernetes' own name and label syntax (as the APIs below restate it).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
GROUP = string(r"^$|" + DNS_SUBDOMAIN, max_length=253)
KIND = string(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$", 1, 63)
OBJECT_NAME = string(min_length=1, max_length=253)
NAMESPACE = string(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", 1, 63)
PORT_NUMBER = integer(1, 65535)
# metav1.LabelSelector (prometheus-operator's selectors are this type).
LABEL_SELECTOR = obj(
    {
        "matchLabels": string_map(string(LABEL_KEY), string(LABEL_VALUE, max_length=63)),
        "matchExpressions": array(
            obj(
                {"key": string(), "operator": string(enum=("In", "NotIn", "Exists", "DoesNotExist")), "values": array(string())},
                ("key", "operator"),
            )
        ),
    }
)

# GAIE v1.6.0, api/v1/inferencepool_types.go and api/v1/shared_types.go (inference.networking.k8s.io/v1).
INFERENCE_POOL = resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    obj(
        {
            "selector": obj(
                {
                    "matchLabels": string_map(
                        string(LABEL_KEY, 1, 253), string(LABEL_VALUE, 0, 63), minProperties=1, maxProperties=64
                    )
                },
                ("matchLabels",),
            ),
            # Unique port numbers (a CEL rule there); Port has only `number`, so unique items say the same.
            "targetPorts": array(obj({"number": PORT_NUMBER}, ("number",)), 1, 8, uniqueItems=True),
            "appProtocol": string(enum=("http", "kubernetes.io/h2c")),
            "endpointPickerRef": obj(
                {
                    "group": GROUP,
                    "kind": KIND,
                    "name": OBJECT_NAME,
                    "port": obj({"number": PORT_NUMBER}, ("number",)),
                    "failureMode": string(enum=("FailOpen", "FailClose")),
                },
                ("name",),
                # "port is required when kind is 'Service' or unspecified (defaults to 'Service')" (a CEL rule there).
                **{"if": {"properties": {"kind": {"const": "Service"}}}, "then": {"required": ["port"]}},
            ),
        },
        ("selector", "targetPorts"),
    ),
)

# Gateway API v1.6.1 (standard channel), apis/v1/httproute_types.go, shared_types.go and
# object_reference_types.go (gateway.networking.k8s.io/v1). Route filters are not written here.
GATEWAY_DURATION = string(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
SECTION_NAME = string(DNS_SUBDOMAIN, 1, 253)
HEADER_NAME = string(r"^[A-Za-z0-9!#$%&'*+\-.^_\x60|~]+$", 1, 256)
HTTP_ROUTE = resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    obj(
        {
            "parentRefs": array(
                obj(
                    {
                        "group": GROUP,
                        "kind": KIND,
                        "namespace": NAMESPACE,
                        "name": OBJECT_NAME,
                        "sectionName": SECTION_NAME,
                        "port": PORT_NUMBER,
                    },
                    ("name",),
                ),
                max_items=32,
            ),
            "hostnames": array(string(r"^(\*\.)?" + DNS_SUBDOMAIN[1:], 1, 253), max_items=16),
            "rules": array(
                obj(
                    {
                        "name": SECTION_NAME,
                        "matches": array(
                            obj(
                                {
                                    "path": obj(
                                        {
                                            "type": string(enum=("Exact", "PathPrefix", "RegularExpression")),
                                            "value": string(max_length=1024),
                                        }
                                    ),
                                    "headers": array(
                                        obj(
                                            {
                                                "type": string(enum=("Exact", "RegularExpression")),
                                                "name": HEADER_NAME,
                                                "value": string(min_length=1, max_length=4096),
                                            },
                                            ("name", "value"),
                                        ),
                                        max_items=16,
                                    ),
                                    "queryParams": array(
                                        obj(
                                            {
                                                "type": string(enum=("Exact", "RegularExpression")),
                                                "name": HEADER_NAME,
                                                "value": string(min_length=1, max_length=1024),
                                            },
                                            ("name", "value"),
                                        ),
                                        max_items=16,
                                    ),
                                    "method": string(
                                        enum=("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
                                    ),
                                }
                            ),
                            max_items=64,
                        ),
                        "backendRefs": array(
                            obj(
                                {
                                    "group": GROUP,
                                    "kind": KIND,
                                    "name": OBJECT_NAME,
                                    "namespace": NAMESPACE,
                                    "port": PORT_NUMBER,
                                    "weight": integer(0, 1000000),
                                },
                                ("name",),
                                # "Must have port for Service reference" (a CEL rule there): group "" and kind Service are the defaults.
                                **{
                                    "if": {"properties": {"group": {"const": ""}, "kind": {"const": "Service"}}},
                                    "then": {"required": ["port"]},
                                },
                            ),
                            max_items=16,
                        ),
                        "timeouts": obj({"request": GATEWAY_DURATION, "backendRequest": GATEWAY_DURATION}),
                    }
                ),
                1,
                16,
            ),
        }
    ),
)

# prometheus-operator v0.93.0, pkg/apis/monitoring/v1/{servicemonitor,podmonitor,prometheusrule}_types.go
# and types.go (monitoring.coreos.com/v1).
PROM_DURATION = string(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
SCHEME = string(enum=("http", "https", "HTTP", "HTTPS"))
NAMESPACE_SELECTOR = obj({"any": {"type": "boolean"}, "matchNames": array(string())})
SCRAPE = {
    "path": string(),
    "scheme": SCHEME,
    "params": string_map(value=array(string())),
    "interval": PROM_DURATION,
    "scrapeTimeout": PROM_DURATION,
    "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"},
}
MONITOR_SPEC = {
    "jobLabel": string(),
    "podTargetLabels": array(string()),
    "namespaceSelector": NAMESPACE_SELECTOR,
    "selector": LABEL_SELECTOR,
    "sampleLimit": integer(0),
    "targetLimit": integer(0),
}
SERVICE_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    obj(
        {
            **MONITOR_SPEC,
            "targetLabels": array(string()),
            "endpoints": array(obj({"port": string(), "targetPort": {"type": ["integer", "string"]}, **SCRAPE})),
        },
        ("endpoints", "selector"),
    ),
)
POD_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    obj(
        {
            **MONITOR_SPEC,
            "podMetricsEndpoints": array(
                obj({"port": string(), "portNumber": PORT_NUMBER, "targetPort": {"type": ["integer", "string"]}, **SCRAPE})
            ),
        },
        ("podMetricsEndpoints", "selector"),
    ),
)
PROMETHEUS_RULE = resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    obj(
        {
            "groups": array(
                obj(
                    {
                        "name": string(min_length=1),
                        "labels": string_map(),
                        "interval": PROM_DURATION,
                        "query_offset": PROM_DURATION,
                        "limit": integer(),
                        "partial_response_strategy": string(
                            r"(?i)^(abort|warn)?$"
                        ),  # theirs: ^(?i)..., which Python's re refuses
                        "rules": array(
                            obj(
                                {
                                    "record": string(),
                                    "alert": string(),
                                    "expr": {"type": ["string", "integer"]},
                                    "for": PROM_DURATION,
                                    "keep_firing_for": string(PROM_DURATION["pattern"], 1),
                                    "labels": string_map(),
                                    "annotations": string_map(),
                                },
                                ("expr",),
                                # A rule records or alerts, never both (Prometheus' rule file format; the operator's webhook checks it).
                                oneOf=[{"required": ["alert"]}, {"required": ["record"]}],
                            )
                        ),
                    },
                    ("name",),
                )
            ),
        }
    ),
)

SCHEMAS: dict[tuple[str, str], Schema] = {
    (s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"]): s
    for s in (INFERENCE_POOL, HTTP_ROUTE, SERVICE_MONITOR, POD_MONITOR, PROMETHEUS_RULE)
}


def errors(doc: dict[str, Any]) -> list[str]:
    """'kind/name: path: message' for each way `doc` breaks its schema ([] if it has none here)."""
    import jsonschema

    schema = SCHEMAS.get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if schema is None:
        return []
    name = f"{doc['kind'].lower()}/{doc.get('metadata', {}).get('name', '?')}"
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{name}: {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def main(argv: list[str]) -> int:
    import yaml

    found = []
    for path in argv:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    found += [f"ERROR {path}: {line}" for line in errors(doc)]
    print("\n".join(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
