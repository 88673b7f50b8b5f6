"""OpenTelemetry traces of a request across exo's processes; the only package that imports opentelemetry.

Off unless an OTLP endpoint is set (docs/operations.md, "Traces"): then every call here is a
check of one module global and returns a shared no-op. On, a chat request is one trace from the
API node to the runner and back, its context carried between processes as a W3C `traceparent`
in NATS message headers and in the runner's Generate request (docs/architecture.md's seven hops).
"""
