"""The request and response types of the HTTP API (`<Verb>Request` / `<Verb>Response`), with the examples
/docs shows, beside their routes: app/schemas/X.py holds the types of app/api/routes/X.py, and shared.py
what several share (`Strict`, the base of every request type, with its strictness rule; the named examples).

Limits that depend on settings (inputs per request, tokens per input) are checked in
app/serving/pipelines.py, since a JSON schema cannot read the environment; the fields' descriptions
document them. A single input gets a single result, a list of inputs a list of results in the same order.
"""
