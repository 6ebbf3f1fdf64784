"""Lineage of merge snapshots: which checkpoints (and earlier snapshots) a snapshot was built from.

A committed merge is catalogued as a checkpoint of kind ``snapshot`` named ``<ref>@<version>``; its id is
the snapshot id, and ``mp_lineage`` holds one row per (snapshot, parent) edge. A snapshot can itself be the
base or an expert of a later merge, so lineage is a DAG that ends in original (ingested) checkpoints.

`lineage_graph` walks it with one recursive query (SQLAlchemy Core, bound parameters only); the renderers
turn the graph into an indented text tree, a Mermaid flowchart, or JSON.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from mergepipe_db.core.units import fmt_bytes
from mergepipe_db.db import schema
from mergepipe_db.db.checkpoints import resolve
from mergepipe_db.db.engine import Database

#: A lineage deeper than this is refused (a cycle cannot occur with content ids; this guards the query).
MAX_DEPTH = 256

FORMATS = ("text", "mermaid", "json")


def _edges(conn: sa.Connection, root_id: str) -> list[sa.Row[Any]]:
    """Every lineage edge reachable from `root_id` (recursive CTE; UNION removes shared sub-trees)."""
    lin = schema.lineage
    anchor = sa.select(lin.c.child_id, lin.c.parent_id, lin.c.role, lin.c.position, lin.c.snapshot_id,
                       sa.literal_column("1").label("depth")).where(lin.c.child_id == root_id)
    walk = anchor.cte("walk", recursive=True)
    step = (sa.select(lin.c.child_id, lin.c.parent_id, lin.c.role, lin.c.position, lin.c.snapshot_id,
                      (walk.c.depth + 1).label("depth"))
            .join(walk, lin.c.child_id == walk.c.parent_id)
            .where(walk.c.depth < MAX_DEPTH))
    walk = walk.union_all(step)
    q = (sa.select(walk.c.child_id, walk.c.parent_id, walk.c.role, walk.c.position, walk.c.snapshot_id)
         .distinct())
    return list(conn.execute(q))


def _snapshot_info(row: Any) -> dict[str, Any]:
    return {
        "id": row.id, "ref": row.ref, "method": row.method, "plan_hash": row.plan_hash,
        "budget_bytes": int(row.budget_bytes), "planned_bytes": int(row.planned_bytes),
        "realized_bytes": int(row.realized_bytes), "full_bytes": int(row.full_bytes),
        "bound": None if row.bound is None else float(row.bound), "seed": int(row.seed),
        "out_path": row.out_path, "created_at": row.created_at,
    }


def lineage_graph(db: Database, snapshot_ref: str) -> dict[str, Any]:
    """The lineage DAG of `snapshot_ref` (checkpoint name, ref, or snapshot id), back to original checkpoints.

    Returns ``{"root": id, "nodes": [...], "edges": [...]}``. A node is a checkpoint: id, name, kind and,
    for merge outputs, ``snapshot`` (method, plan hash, budget/planned/realized/full expert bytes, bound, …;
    bytes are bytes). An edge is (child, parent, role ``base``/``expert``, position, ``bytes_read``: the bytes
    the child's merge read from that input, and the child's merge: method, budget_bytes, plan_hash). Nodes are
    sorted root first, then by name; edges by child, role, position. A checkpoint that is not a merge output
    yields one node and no edges.
    Raises UnknownCheckpointError for an unknown name.
    """
    c, s = schema.checkpoint, schema.snapshot
    with db.connect() as conn:
        root = resolve(conn, snapshot_ref)
        edges = _edges(conn, root.checkpoint_id)
        ids = sorted({root.checkpoint_id} | {e.child_id for e in edges} | {e.parent_id for e in edges})
        cps = {r.id: r for r in conn.execute(sa.select(c.c.id, c.c.name, c.c.kind).where(c.c.id.in_(ids)))}
        snaps = {r.checkpoint_id: r for r in conn.execute(
            sa.select(s).where(s.c.checkpoint_id.in_(ids), s.c.state == "COMMITTED"))}
        rd = schema.read_stat
        read = {(r.snapshot_id, int(r.position)): int(r.bytes_read) for r in conn.execute(
            sa.select(rd.c.snapshot_id, rd.c.position, sa.func.sum(rd.c.bytes_read).label("bytes_read"))
            .where(rd.c.snapshot_id.in_([sn.id for sn in snaps.values()]))
            .group_by(rd.c.snapshot_id, rd.c.position))}
    nodes = []
    for cid in ids:
        cp = cps.get(cid)
        snap = snaps.get(cid)
        nodes.append({
            "id": cid, "name": cp.name if cp is not None else cid, "kind": cp.kind if cp is not None else "missing",
            "snapshot": _snapshot_info(snap) if snap is not None else None,
        })
    nodes.sort(key=lambda n: (n["id"] != root.checkpoint_id, n["name"], n["id"]))
    names = {n["id"]: n["name"] for n in nodes}
    out_edges = []
    for e in edges:
        snap = snaps.get(e.child_id)
        out_edges.append({
            "child": e.child_id, "child_name": names[e.child_id], "parent": e.parent_id,
            "parent_name": names[e.parent_id], "role": e.role, "position": int(e.position),
            "snapshot_id": e.snapshot_id,
            "method": snap.method if snap is not None else None,
            "budget_bytes": int(snap.budget_bytes) if snap is not None else None,
            "plan_hash": snap.plan_hash if snap is not None else None,
            # bytes the child's merge read from this input: the base's (boundary cost) or this expert's
            "bytes_read": None if snap is None else (int(snap.base_bytes) if e.role == "base"
                                                     else read.get((snap.id, int(e.position)), 0)),
        })
    out_edges.sort(key=lambda e: (names[e["child"]], e["role"] != "base", e["position"], e["parent_name"]))
    return {"root": root.checkpoint_id, "nodes": nodes, "edges": out_edges}


# --- renderers ------------------------------------------------------------------------------------------


def _parents(graph: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in graph["edges"]:
        out.setdefault(e["child"], []).append(e)
    return out


def _describe(node: dict[str, Any]) -> str:
    s = node["snapshot"]
    if s is None:
        return f"{node['name']} ({node['kind']})"
    bound = "" if s["bound"] is None else f", bound {s['bound']:.4g}"
    return (f"{node['name']} (snapshot {s['id'][:12]}: {s['method']}, read {fmt_bytes(s['realized_bytes'])} "
            f"of budget {fmt_bytes(s['budget_bytes'])} / full {fmt_bytes(s['full_bytes'])}{bound}, "
            f"plan {s['plan_hash'][:12]})")


def render_text(graph: dict[str, Any]) -> str:
    """An indented tree, root first. A parent shared by several merges is listed under each of them; the
    parents of a snapshot already expanded above are not repeated (``…``), so the output stays linear."""
    nodes = {n["id"]: n for n in graph["nodes"]}
    parents = _parents(graph)
    lines = [_describe(nodes[graph["root"]])]
    expanded = {graph["root"]}

    def walk(cid: str, prefix: str, depth: int) -> None:
        kids = parents.get(cid, [])
        for i, e in enumerate(kids):
            last = i == len(kids) - 1
            role = "base" if e["role"] == "base" else f"expert {e['position']}"
            seen = e["parent"] in expanded and e["parent"] in parents
            more = " … (parents listed above)" if seen else ""
            read = "" if e.get("bytes_read") is None else f" [read {fmt_bytes(e['bytes_read'])}]"
            lines.append(f"{prefix}{'└── ' if last else '├── '}{role}{read}: {_describe(nodes[e['parent']])}{more}")
            if not seen and depth < MAX_DEPTH:
                expanded.add(e["parent"])
                walk(e["parent"], prefix + ("    " if last else "│   "), depth + 1)

    walk(graph["root"], "", 1)
    return "\n".join(lines)


_MERMAID_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _.,:@+-=/%()")


def mermaid_escape(text: str) -> str:
    """Text for inside a quoted Mermaid label: every character outside a small safe set becomes ``#NNN;``."""
    return "".join(ch if ch in _MERMAID_SAFE else f"#{ord(ch)};" for ch in text)


def render_mermaid(graph: dict[str, Any]) -> str:
    """A Mermaid flowchart: one node per checkpoint (a merge output with its operator, budget, bytes read and
    plan hash prefix), an arrow parent → child per lineage edge, labelled with the role and the bytes the
    child's merge read from that parent."""
    ids = {n["id"]: f"n{i}" for i, n in enumerate(graph["nodes"])}
    lines = ["flowchart BT"]
    for n in graph["nodes"]:
        s = n["snapshot"]
        if s is None:
            label = f"{mermaid_escape(n['name'])}<br/>{mermaid_escape(n['kind'])}"
            lines.append(f'    {ids[n["id"]]}["{label}"]')
        else:
            label = (f"{mermaid_escape(n['name'])}<br/>snapshot {s['id'][:12]}: {mermaid_escape(s['method'])}<br/>"
                     f"read {mermaid_escape(fmt_bytes(s['realized_bytes']))} of budget "
                     f"{mermaid_escape(fmt_bytes(s['budget_bytes']))}, plan {s['plan_hash'][:8]}")
            lines.append(f'    {ids[n["id"]]}(["{label}"])')
    for e in graph["edges"]:
        role = "base" if e["role"] == "base" else f"expert {e['position']}"
        read = "" if e.get("bytes_read") is None else f", read {mermaid_escape(fmt_bytes(e['bytes_read']))}"
        label = f"{role}{read}"
        lines.append(f'    {ids[e["parent"]]} -->|"{label}"| {ids[e["child"]]}')
    root = ids[graph["root"]]
    lines.append("    classDef root stroke-width:3px")
    lines.append(f"    class {root} root")
    return "\n".join(lines)


def render_json(graph: dict[str, Any]) -> str:
    return json.dumps(graph, indent=2, sort_keys=False)


def render(graph: dict[str, Any], fmt: str = "text") -> str:
    """Render `graph` as ``text``, ``mermaid`` or ``json``."""
    if fmt == "text":
        return render_text(graph)
    if fmt == "mermaid":
        return render_mermaid(graph)
    if fmt == "json":
        return render_json(graph)
    from mergepipe_db.errors import SpecError

    raise SpecError(f"unknown lineage format {fmt!r}; use one of {', '.join(FORMATS)}")
