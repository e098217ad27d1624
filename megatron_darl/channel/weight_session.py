"""SGLang 0.5.23's weight-update session, as both sides of a weight push speak it.

What it is: the routes that need a session and the release's messages, verbatim
(`srt/managers/scheduler_components/weight_updater.py`): `SESSION_ROUTES` are refused (400,
success=false, before anything is received) unless a session opened by /begin_weight_update is
open; /begin_weight_update is refused while one is open and /end_weight_update while none is. A
TP/DP server joins its ranks' messages with " | ", so match them as substrings. The learner's
sender and the rollout manager ask for sessions (`rollout/sglang_requests.py` re-exports these);
darl-engine holds the rules (`engine/weight_group.py`). tests/unit/rollout/test_sglang_conformance.py
reads all of this back from the wheel.
What it is not: the client or the server of the session.
"""

SESSION_ROUTES = ("/update_weights_from_distributed", "/update_weights_from_tensor")
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
SESSION_SELECTORS = ("target", "draft", "all")


def session_required(route: str) -> str:
    """The release's refusal of a SESSION_ROUTES call made outside a session."""
    return f"{route.strip('/')} must run between begin_weight_update() and end_weight_update()"
