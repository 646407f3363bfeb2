"""Who a request is: its tenant, for fair share (``--scheduling-policy fair``), the per-tenant caps
and the metrics by tenant.

Where the server has several API keys (``--api-key k1,k2``), the key is the tenant: a client
cannot pass for another by writing a field. Each key's tenant is named ``key-`` and the first 8
hex digits of the key's SHA-256, so that neither the logs nor the metrics show a key (the names
are logged at start, for ``--tenant-weights``). Where keys are shared (one key, or none), the
tenant is the body's user field: OpenAI's ``user``, the Responses API's ``user`` or
``safety_identifier``, Anthropic's ``metadata.user_id``; with none, the request is anonymous.
"""

from __future__ import annotations

import dataclasses
import hashlib
from contextvars import ContextVar

from duoserve.sampling_params import SamplingParams

# set by the API key guard for the request it lets through, where keys name tenants
KEY_TENANT: ContextVar[str | None] = ContextVar("duoserve_key_tenant", default=None)


def split_keys(api_key: str | None) -> list[str]:
    """``--api-key``'s keys: one, or several comma-separated (llama.cpp's form)."""
    return [key.strip() for key in (api_key or "").split(",") if key.strip()]


def key_tenant(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def with_tenant(params: SamplingParams) -> SamplingParams:
    """``params`` under the request's key's tenant, where keys name tenants (else as they are)."""
    tenant = KEY_TENANT.get()
    if tenant is None or tenant == params.tenant:
        return params
    return dataclasses.replace(params, tenant=tenant)
