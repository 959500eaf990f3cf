"""A call fitted to a lighter level's contract (L2 of ``fallback``), or why it cannot be: the
lighter model must answer what this route answers. Inputs it does not take are dropped (and
said so); inputs it needs that the call lacks, and outputs the client gets from this route (the
ones it asked for, else all of the route's) that it does not answer under the same name and
datatype, make the level skip the call: its answer would be another model's, not this route's
(red team, round 3: a client asking for OUTPUT0 got a 400 naming the internal route; one asking
for nothing got OUT_LIGHT in place of OUTPUT0).
"""

from __future__ import annotations

from proxy.call import Api, Call
from proxy.chain import FilterContext
from proxy.contract import ModelContract
from proxy.wire.openai import ChatView


def adapt(call: Call, level: str, ctx: FilterContext) -> str:
    """Fit ``call`` to the route ``level``'s contract; "" when it fits, else why not."""
    found = ctx.lookup(level)
    contract = found[1] if found else None
    if contract is None:
        return "its contract is not known yet"
    if call.api is Api.OPENAI:
        view = ChatView(call)
        images = view.images()
        if images and contract.accepts_images is False:
            for image in reversed(images):
                view.drop_image(image)
            ctx.telemetry.decide(call, "fallback", "adapt", f"dropped {len(images)} "
                                 f"image(s) for text-only '{level}'", header="adapt")
        return ""
    keep = [t for t in call.inputs if contract.input(t.name) is not None]
    dropped = [t.name for t in call.inputs if contract.input(t.name) is None]
    missing = [s.name for s in contract.inputs
               if not s.optional and s.name not in {t.name for t in keep}]
    if missing:
        return f"cannot adapt: it needs input(s) {missing} the call does not have"
    lacking = lacking_outputs(call, contract, ctx)
    if lacking:
        return f"cannot adapt: it has no output(s) {lacking} as this route answers them"
    if dropped:
        call.set_inputs(keep)
        ctx.telemetry.decide(call, "fallback", "adapt", f"dropped input(s) {dropped} "
                             f"for '{level}'", header="adapt")
    return ""


def lacking_outputs(call: Call, contract: ModelContract, ctx: FilterContext) -> list[str]:
    """The outputs the client gets from this route that ``contract`` does not answer under the
    same name and datatype."""
    found = ctx.lookup(ctx.route)
    own = found[1] if found else None
    wanted = ([o.name for o in call.outputs] if call.outputs
              else [t.name for t in own.outputs] if own is not None else [])
    lacking = []
    for name in wanted:
        theirs = contract.output(name)
        mine = own.output(name) if own is not None else None
        if theirs is None or (mine is not None and mine.datatype != theirs.datatype):
            lacking.append(name)
    return lacking
