"""The wire protocol: round trips, validation, and PROTOCOL.md agreeing with the code."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redbatch.common import protocol as p
from redbatch.common.config import Settings
from redbatch.common.protocol import (
    ErrorCode,
    JobEnvelope,
    Keys,
    Lane,
    ProtocolError,
    ResultEnvelope,
    Status,
)
from redbatch.handlers.decode import ALLOWED_FORMATS, REFUSED_SIGNATURES
from redbatch.handlers.text import MAX_TEXT_BYTES, MAX_TEXTS, MAX_TOKENS

DOC = (Path(__file__).resolve().parent.parent / "PROTOCOL.md").read_text()
MAX = 1024 * 1024


def job(**kw: object) -> JobEnvelope:
    base: dict[str, object] = dict(request_id="r1", model="m", payload=b"\x00\x01",
                                   content_type="image/jpeg", submitted_ms=1000,
                                   deadline_ms=3000, lane=Lane.BULK, params={"k": 1})
    base.update(kw)
    return JobEnvelope(**base)  # type: ignore[arg-type]


def fields_with(body: object, rid: bytes = b"r1") -> dict[bytes, bytes]:
    return {b"rid": rid, b"job": msgpack.packb(body, use_bin_type=True)}


def good_body() -> dict[str, object]:
    return dict(v=1, model="m", payload=b"x", content_type="", submitted_ms=1,
                deadline_ms=None, lane="interactive", params={})


def test_job_round_trip() -> None:
    original = job()
    encoded = {k.encode(): v for k, v in original.encode().items()}
    assert JobEnvelope.decode(encoded, MAX) == original
    assert original.budget_ms == 2000
    assert b"done_only" not in original.encode()[p.FIELD_JOB]  # written only when set
    done_only = job(done_only=True)
    fields = {k.encode(): v for k, v in done_only.encode().items()}
    assert JobEnvelope.decode(fields, MAX) == done_only


def test_result_round_trip_ok_and_error() -> None:
    ok = ResultEnvelope("r1", Status.OK, output={"label": "x", "top5": [1, 2]},
                        timings={"queue_ms": 1.5}, batch_size=4, worker="w", model="m",
                        finished_ms=7)
    assert ResultEnvelope.decode(ok.encode()) == ok
    err = ResultEnvelope.error("r2", ErrorCode.BAD_IMAGE, "nope", worker="w")
    back = ResultEnvelope.decode(err.encode())
    assert back == err and not back.ok and back.error_code is ErrorCode.BAD_IMAGE


def test_reply_keys_are_the_only_lists_a_job_may_name() -> None:
    k = Keys("m", "rb")
    assert k.is_reply(k.reply("run-1"))
    for key in ["rb:{m}:result:x", "rb:{m}:reply:../x", "rb:{other}:reply:a", "rb:{m}:reply:",
                "rb:{m}:jobs:interactive", "other:{m}:reply:a"]:
        assert not k.is_reply(key), key


def test_keys_share_one_hash_tag() -> None:
    k = Keys("resnet50", "rb")
    names = [*k.streams(), k.result("a"), k.done("a"), k.reply("r")]
    assert all(n.startswith("rb:{resnet50}:") for n in names)
    assert k.stream(Lane.INTERACTIVE) == "rb:{resnet50}:jobs:interactive"
    assert k.streams()[0].endswith("interactive"), "interactive is served first"


@pytest.mark.parametrize("name", ["", "../etc", "a/b", "{x}", "a b", "x" * 65, "-lead"])
def test_unsafe_model_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        Keys(name)


@pytest.mark.parametrize("body, code", [
    ({**good_body(), "v": 2}, ErrorCode.UNSUPPORTED_VERSION),
    ({**good_body(), "v": True}, ErrorCode.BAD_ENVELOPE),
    ({k: v for k, v in good_body().items() if k != "model"}, ErrorCode.BAD_ENVELOPE),
    ({**good_body(), "payload": "text, not bin"}, ErrorCode.BAD_ENVELOPE),
    ({**good_body(), "lane": "vip"}, ErrorCode.BAD_ENVELOPE),
    ({**good_body(), "done_only": 1}, ErrorCode.BAD_ENVELOPE),
    ({**good_body(), "model": "../../x"}, ErrorCode.BAD_ENVELOPE),
    ({**good_body(), "params": {"a": {"nested": [1]}}}, ErrorCode.BAD_ENVELOPE),
    ({**good_body(), "params": [1, 2]}, ErrorCode.BAD_ENVELOPE),
    ({**good_body(), "payload": b"x" * (MAX + 1)}, ErrorCode.PAYLOAD_TOO_LARGE),
    ([1, 2, 3], ErrorCode.BAD_ENVELOPE),
    ("a string", ErrorCode.BAD_ENVELOPE),
])
def test_invalid_job_bodies_keep_the_request_id(body: object, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        JobEnvelope.decode(fields_with(body), MAX)
    assert info.value.code is code
    assert info.value.request_id == "r1"


@pytest.mark.parametrize("raw", [
    b"",
    b"not msgpack at all",
    pickle.dumps({"v": 1}),
    msgpack.packb(msgpack.ExtType(1, b"pickle-ish")),
])
def test_undecodable_bodies_are_bad_envelopes(raw: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        JobEnvelope.decode({b"rid": b"r9", b"job": raw}, MAX)
    assert info.value.code in (ErrorCode.BAD_ENVELOPE, ErrorCode.PAYLOAD_TOO_LARGE)
    assert info.value.request_id == "r9"


@pytest.mark.parametrize("fields", [
    {b"job": msgpack.packb(good_body())},
    fields_with(good_body(), rid=b"has space"),
    fields_with(good_body(), rid=b"\xff\xfe"),
    fields_with(good_body(), rid=b"x" * 200),
])
def test_entries_without_a_usable_request_id(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(ProtocolError) as info:
        JobEnvelope.decode(fields, MAX)
    assert info.value.code is ErrorCode.BAD_REQUEST_ID and info.value.request_id is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_job_decoder_raises_only_protocol_errors(raw: bytes) -> None:
    try:
        JobEnvelope.decode({b"rid": b"f", b"job": raw}, MAX)
    except ProtocolError:
        pass


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(),
                     st.text(max_size=8), st.binary(max_size=8))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(list(good_body()) + ["extra"]),
                       st.recursive(_scalars, lambda c: st.lists(c, max_size=3)
                                    | st.dictionaries(st.text(max_size=4), c, max_size=3),
                                    max_leaves=8)))
def test_fuzz_structured_bodies_raise_only_protocol_errors(body: dict[str, object]) -> None:
    try:
        JobEnvelope.decode(fields_with({**good_body(), **body}), MAX)
    except ProtocolError:
        pass


# --------------------------------------------------------------------- PROTOCOL.md == code


def _table_first_column(heading: str) -> set[str]:
    section = DOC.split(heading, 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \|", section.split("\n#", 1)[0], re.M)
    return set(rows)


def test_doc_lists_every_error_code() -> None:
    assert _table_first_column("### Error codes") == {c.value for c in ErrorCode}


def test_doc_job_envelope_matches_code() -> None:
    encoded = msgpack.unpackb(job(reply_to="x", done_only=True).encode()[p.FIELD_JOB])
    assert _table_first_column("### Job envelope") == set(encoded)


def test_doc_result_envelope_matches_code() -> None:
    encoded = msgpack.unpackb(ResultEnvelope("r", Status.OK).encode())
    assert _table_first_column("### Result envelope") == set(encoded)


def test_doc_names_keys_fields_and_group() -> None:
    k = Keys("efficientnet_lite0")
    for name in [*k.streams(), k.result("abc"), k.done("abc")]:
        assert f"`{name}`" in DOC
    assert k.reply("NAME").replace("efficientnet_lite0", "M").replace("redbatch", "P") in DOC
    assert "rid <request id> job <msgpack job envelope>" in DOC
    assert (p.FIELD_REQUEST_ID, p.FIELD_JOB) == ("rid", "job")
    # Entries of the admission script carry a third field, adm (1), which the script sets.
    assert p.FIELD_ADMITTED == "adm" and "a third field, `adm` (`1`)" in " ".join(DOC.split())
    assert "'rid', rid, 'job', ARGV[4 * i + 1], 'adm', '1')\n" in p.ADMIT_SCRIPT
    assert "local owner, rid, charge = KEYS[3 + i], ARGV[4 * i - 1], tonumber(ARGV[4 * i])" \
        in p.ADMIT_SCRIPT
    assert f"| consumer group | `{p.GROUP}` |" in DOC
    for lane in Lane:
        assert f"`{lane.value}`" in DOC
    for timing in p.TIMING_NAMES:
        assert f"`{timing}`" in DOC


def _tables_first_columns(heading: str) -> list[set[str]]:
    """The first column of each table of the section under ``heading``."""
    section = DOC.split(heading, 1)[1].split("\n#", 1)[0]
    tables = re.split(r"\n(?!\|)[^\n]*\n(?=\| )", section)
    return [set(rows) for table in tables
            if (rows := re.findall(r"^\| `([^`]+)` \|", table, re.M))]


def test_doc_gives_the_admission_script_and_limits_key() -> None:
    assert f"```lua\n{p.ADMIT_SCRIPT}```" in DOC, "PROTOCOL.md holds the script verbatim"
    assert Keys("M", "P").limits() == "P:{M}:limits" and "`P:{M}:limits`" in DOC
    assert Keys("M", "P").charges(Lane.BULK) == "P:{M}:charges:bulk"
    assert "`P:{M}:charges:<lane>`" in DOC and "`<lane>:tokens`" in DOC
    assert p.token_bound_field(Lane.BULK) == "bulk:tokens" and "`bulk:tokens`" in DOC
    # Revision 3 replies an array with an element per job (an entry id, or an error element
    # QUEUE_FULL / DUPLICATE_REQUEST_ID), or one error for the whole call (BAD_CALL,
    # NOPERM): the page's two tables, each code in the table of its kind of reply.
    elements, whole_call = _tables_first_columns("#### Replies, as they arrive")
    element_codes = {row[1:].split(" ")[0] for row in elements if row.startswith("-")}
    call_codes = {row[1:].split(" ")[0] for row in whole_call if row.startswith("-")}
    assert element_codes == {p.QUEUE_FULL_REPLY, p.TOKENS_FULL_REPLY, p.DUPLICATE_REPLY}
    assert call_codes == {p.BAD_CALL_REPLY, p.NOPERM_REPLY}
    for code in p.ADMIT_ERROR_CODES:
        assert any(row.startswith(f"-{code} <") for row in elements | whole_call), code
    # Each error the script makes is "CODE text", which Redis passes on without "ERR ":
    # error elements as {err = 'CODE ' .. text}, whole-call errors through error_reply
    # (BAD_CALL through its helper bad()).
    made_elements = re.findall(r"\{err = '([A-Z_]+) ", p.ADMIT_SCRIPT)
    made_errors = re.findall(r"error_reply\('([A-Z_]+) ", p.ADMIT_SCRIPT)
    assert sorted(set(made_elements)) == sorted(element_codes), made_elements
    assert sorted(set(made_errors)) == sorted(call_codes), made_errors
    assert p.ADMIT_SCRIPT.count("{err =") == len(made_elements)
    assert p.ADMIT_SCRIPT.count("error_reply(") == len(made_errors)
    assert sorted({*made_elements, *made_errors}) == sorted(p.ADMIT_ERROR_CODES)


def test_doc_gives_the_admission_call_line_of_the_code() -> None:
    """The page's call line (3 + N keys, 1 + 4N arguments) is the one the client builds,
    for one job and for several, and the most jobs of a call is MAX_ADMIT_JOBS."""
    from redbatch.common.protocol.functions import ADMIT_FUNCTION
    from redbatch.producer.admission import admission_call

    line = re.search(rf"^FCALL {ADMIT_FUNCTION} <3 \+ N> (.*)$", DOC, re.M)
    assert line is not None, "the page's call line"
    assert line.group(1) == (
        "P:{M}:jobs:<lane> P:{M}:limits P:{M}:charges:<lane> P:{M}:owner:<request id 1> ... "
        "P:{M}:owner:<request id N> <lane> <owner ttl ms 1> <request id 1> <charge 1> "
        "<msgpack job envelope 1> ... <owner ttl ms N> <request id N> <charge N> "
        "<msgpack job envelope N>")
    keys = Keys("m", "rb")
    for n in (1, 3):
        jobs = [job(request_id=f"r{i}", lane=Lane.INTERACTIVE, deadline_ms=None)
                for i in range(n)]
        call = admission_call(keys, jobs)
        assert call.keys == [keys.stream(Lane.INTERACTIVE), keys.limits(),
                             keys.charges(Lane.INTERACTIVE),
                             *(keys.owner(f"r{i}") for i in range(n))]
        assert call.args == ["interactive", *(arg for j in jobs for arg in (
            p.owner_ttl_ms(None), j.request_id, 0, j.encode()[p.FIELD_JOB]))]
        assert len(call.keys) == 3 + n and len(call.args) == 1 + 4 * n
    text = " ".join(DOC.split())
    assert f"admits one job or many (up to {p.MAX_ADMIT_JOBS:,})" in text
    assert f"N from 1 to {p.MAX_ADMIT_JOBS:,}" in text
    assert f"if n < 1 or n > {p.MAX_ADMIT_JOBS} or n % 1 ~= 0 or #KEYS < 3 + n then" \
        in p.ADMIT_SCRIPT
    # The revision the script names is the one the page describes as current.
    revision = re.search(r"\(revision (\d+):", p.ADMIT_SCRIPT.splitlines()[0])
    assert revision is not None and f"Revision {int(revision.group(1)) - 1} admitted" in text


def page_library() -> str:
    """The function library as the page gives it: its frame, each ``<the ... script>``
    line replaced by that script's text from the page."""
    frame = re.search(r"```lua\n(#!lua name=.*?)```", DOC, re.S)
    assert frame is not None, "the page's library"
    scripts = {m.group(1): m.group(0)[len("```lua\n"):-3] for m in re.finditer(
        r"```lua\n-- redbatch (\w+) script.*?```", DOC, re.S)}
    return re.sub(r"^<the (\w+) script>", lambda m: scripts[m.group(1)], frame.group(1),
                  flags=re.M)


def test_doc_gives_the_function_library_of_the_code() -> None:
    """The page's library, assembled as it says, is the text workers load; its table
    names each function with the call it takes (FCALL_RO for the one flagged no-writes)."""
    from redbatch.common.protocol import functions as f

    assert page_library() == f.LIBRARY
    assert f.LIBRARY.startswith(f"#!lua name={f.LIBRARY_NAME}\n")
    rows = {row[0]: row[1] for row in _table_rows("## The function library")}
    assert rows == {f.ADMIT_FUNCTION: "`FCALL`",
                    f.STATUS_FUNCTION: "`FCALL_RO` (flag `no-writes`: it writes nothing)",
                    f.CANCEL_FUNCTION: "`FCALL`"}
    assert f"`{f.MISSING_REPLY.join(['-ERR ', ''])}`" in DOC and "`functions_missing`" in DOC


def _table_rows(heading: str) -> list[list[str]]:
    """The rows of the tables under ``heading`` whose first cell is code, cell by cell
    (the first without its backticks)."""
    section = DOC.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in section.splitlines() if line.startswith("| `")]
    return [[row[0].strip("`"), *row[1:]] for row in rows]


def test_doc_gives_the_owner_ttl_formula_of_the_code() -> None:
    assert "`max(0, deadline_ms - submitted_ms) + 600000`" in DOC
    assert "`3600000` for a job without one" in DOC
    for budget in (-10**12, -1, 0, 1, 5000, 10**9):
        assert p.owner_ttl_ms(budget) == max(0, budget) + 600000 > 0
    assert p.owner_ttl_ms(None) == 3600000 == p.IDEMPOTENCY_WINDOW_MS
    assert f"at most {p.MAX_OWNER_TTL_DIGITS} digits" in DOC
    assert len(str(p.owner_ttl_ms(10**12))) <= p.MAX_OWNER_TTL_DIGITS


def _limits_on_the_page() -> dict[str, int]:
    section = DOC.split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| ([\d,]+)", section, re.M)
    return {name: int(number.replace(",", "")) for name, number in rows}


def test_doc_limits_are_the_limits_in_the_code() -> None:
    defaults = Settings()
    assert _limits_on_the_page() == {
        "payload": defaults.limits.max_payload_bytes,
        "envelope overhead": p.MAX_ENVELOPE_OVERHEAD_BYTES,
        "model name": p.MAX_NAME_CHARS,
        "prefix": p.MAX_NAME_CHARS,
        "reply list name": p.MAX_NAME_CHARS,
        "request id": p.MAX_REQUEST_ID_CHARS,
        "content_type": p.MAX_CONTENT_TYPE_BYTES,
        "params": p.MAX_PARAMS,
        "msgpack str": p.MAX_STR_BYTES,
        "msgpack array": p.MAX_ARRAY_LEN,
        "msgpack map": p.MAX_MAP_LEN,
        "msgpack nesting": p.MAX_DEPTH,
        "image pixels": defaults.limits.max_image_pixels,
        "image side": defaults.limits.max_image_side,
        "deliveries": defaults.max_deliveries,
        "owner TTL": p.MAX_OWNER_TTL_DIGITS,
        "result TTL": defaults.result_ttl_s,
        "dead-letter stream": p.DLQ_MAX_LEN,
        "result envelope": p.MAX_RESULT_BYTES,
        "text, `all_minilm_l6_v2`": MAX_TEXT_BYTES,
        "text tokens, `all_minilm_l6_v2`": MAX_TOKENS,
        "texts in one job, `all_minilm_l6_v2`": MAX_TEXTS,
    }


def test_doc_recognised_formats_are_the_decoders() -> None:
    section = DOC.split("### Recognised formats", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| (\d+) \| `([0-9A-F ]+)` \|", section, re.M)
    assert [(name, int(offset), bytes.fromhex(magic)) for name, offset, magic in rows] == \
        [(sig.name, sig.offset, sig.magic) for sig in REFUSED_SIGNATURES]
    accepted = re.search(r"accepted formats only: ([^.]+)\.", " ".join(section.split()))
    assert accepted is not None
    names = accepted.group(1).replace(" and ", ", ").split(", ")
    assert [n.upper() for n in names] == list(ALLOWED_FORMATS)


@pytest.mark.parametrize("raw, bound", [(None, None), (b"10", 10), ("0", 0), (b"2.5", 3),
                                        (b"-4", 0), (b"lots", None), (b"nan", None),
                                        (b"inf", None)])
def test_queue_bounds_parse_as_the_script_reads_them(raw: bytes | None,
                                                     bound: int | None) -> None:
    assert p.parse_queue_bound(raw) == bound


# --------------------------------------------------------------------- names are matched whole


def test_names_and_request_ids_with_a_trailing_newline_are_refused() -> None:
    for name in ("m\n", "m\r\n", "m ", "\nm"):
        with pytest.raises(ValueError):
            p.validate_name(name)
        assert not p.valid_request_id(name)
    k = Keys("m", "rb")
    assert not k.is_reply(k.reply("run-1") + "\n")
    assert p.parse_job_stream("rb", "rb:{m\n}:jobs:bulk") is None
    assert p.parse_job_stream("rb", "rb:{m}:jobs:bulk") == ("m", Lane.BULK)
    for limit, ok in ((p.MAX_NAME_CHARS, True), (p.MAX_NAME_CHARS + 1, False)):
        assert k.is_reply(f"rb:{{m}}:reply:{'n' * limit}") is ok
        assert p.valid_request_id("r" * (p.MAX_REQUEST_ID_CHARS + limit - p.MAX_NAME_CHARS)) \
            is ok


def test_a_request_id_with_a_newline_is_unusable_and_a_model_name_is_bad_envelope() -> None:
    with pytest.raises(ProtocolError) as info:
        JobEnvelope.decode(fields_with(good_body(), rid=b"r1\n"), MAX)
    assert info.value.code is ErrorCode.BAD_REQUEST_ID and info.value.request_id is None
    with pytest.raises(ProtocolError) as info:
        JobEnvelope.decode(fields_with({**good_body(), "model": "m\n"}), MAX)
    assert info.value.code is ErrorCode.BAD_ENVELOPE, "not wrong_model: it is no model name"
    assert "'m\\n'" in info.value.message


# --------------------------------------------------------------------- limits, enforced


def _decode_code(body: object, max_payload: int = MAX) -> ErrorCode | None:
    try:
        JobEnvelope.decode(fields_with(body), max_payload)
    except ProtocolError as e:
        return e.code
    return None


@pytest.mark.parametrize("make, at_limit", [
    (lambda n: {"content_type": "c" * n}, p.MAX_CONTENT_TYPE_BYTES),
    (lambda n: {"content_type": "é" * (n // 2)}, p.MAX_CONTENT_TYPE_BYTES),  # bytes, not chars
    (lambda n: {"params": {f"k{i}": i for i in range(n)}}, p.MAX_PARAMS),
    (lambda n: {"params": {"k": "s" * n}}, p.MAX_STR_BYTES),
    (lambda n: {"extra": list(range(n))}, p.MAX_ARRAY_LEN),
    (lambda n: {"extra": {str(i): i for i in range(n)}}, p.MAX_MAP_LEN),
    (lambda n: {"model": "m" * n}, p.MAX_NAME_CHARS),
])
def test_each_limit_admits_its_value_and_refuses_one_more(make, at_limit: int) -> None:  # type: ignore[no-untyped-def]
    step = 2 if "é" in str(make(2)) else 1  # two UTF-8 bytes a character
    assert _decode_code({**good_body(), **make(at_limit)}) is None
    assert _decode_code({**good_body(), **make(at_limit + step)}) is ErrorCode.BAD_ENVELOPE


def test_nesting_is_admitted_to_its_limit_and_refused_past_it() -> None:
    body = msgpack.packb(good_body(), use_bin_type=True)
    assert body[0] == 0x88  # a fixmap of 8 entries; one more is added by hand below
    for depth, code in ((p.MAX_DEPTH, None), (p.MAX_DEPTH + 1, ErrorCode.BAD_ENVELOPE)):
        # The body map is the first level, then depth - 1 arrays (packb refuses to nest so).
        extra = b"\xa5extra" + b"\x91" * (depth - 1) + b"\xc0"
        try:
            JobEnvelope.decode({b"rid": b"r1", b"job": b"\x89" + body[1:] + extra}, MAX)
            got = None
        except ProtocolError as e:
            got = e.code
        assert got is code, depth


def test_the_job_field_may_exceed_the_payload_limit_by_the_overhead_only() -> None:
    limit, target = 1000, 1000 + p.MAX_ENVELOPE_OVERHEAD_BYTES
    body = {**good_body(), "payload": b"p" * limit, "pad": b""}
    while (raw := msgpack.packb(body, use_bin_type=True)) and len(raw) != target:
        body["pad"] = b"x" * (len(body["pad"]) + target - len(raw))  # its header may grow
    assert len(raw) == target
    JobEnvelope.decode({b"rid": b"r1", b"job": raw}, limit)
    with pytest.raises(ProtocolError) as info:
        JobEnvelope.decode({b"rid": b"r1", b"job": raw + b"\x00"}, limit)
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE and info.value.request_id == "r1"


def test_a_depth_bomb_says_what_happened() -> None:
    bomb = b"\x81\xa1v" + b"\x91" * 100_000 + b"\xc0"  # {"v": [[[[...]]]]}
    with pytest.raises(ProtocolError) as info:
        JobEnvelope.decode({b"rid": b"r1", b"job": bomb}, MAX)
    assert info.value.code is ErrorCode.BAD_ENVELOPE
    assert info.value.message == f"body nests arrays or maps deeper than {p.MAX_DEPTH} levels"


def test_params_with_bin_keys_are_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        JobEnvelope.decode(fields_with({**good_body(), "params": {b"k": 1}}), MAX)
    assert info.value.code is ErrorCode.BAD_ENVELOPE and "param key b'k'" in info.value.message


def test_doc_gives_the_status_and_cancel_scripts_and_their_replies() -> None:
    """The page holds both scripts verbatim, with their call lines; its cancel table names
    each reply the script makes; its status table names every state the client reports;
    and its payload-type table names each content type of the encoders."""
    from redbatch.common.protocol import payloads

    for script in (p.STATUS_SCRIPT, p.CANCEL_SCRIPT):
        assert f"```lua\n{script}```" in DOC, script.splitlines()[0]
    assert "FCALL_RO redbatch_v2_status 5 P:{M}:result:ID P:{M}:owner:ID " \
           "P:{M}:jobs:interactive P:{M}:jobs:bulk P:{M}:done:ID" in DOC
    assert "FCALL redbatch_v2_cancel 3 P:{M}:jobs:interactive P:{M}:jobs:bulk " \
           "P:{M}:owner:ID ID <msgpack job envelope>" in DOC
    made = set(re.findall(r"return '([a-z]+)", p.CANCEL_SCRIPT))
    assert made == {p.CANCELLED_REPLY, p.TAKEN_REPLY, p.UNKNOWN_REPLY}
    cancel = DOC[DOC.index("## Cancelling a job"):DOC.index("## Dead letters")]
    for reply in made:
        assert f"| `{reply}" in cancel, reply
    status = DOC[DOC.index("## Job status"):DOC.index("## Cancelling a job")]
    for state in p.JobState:
        assert f"`{state.value}`" in status, state
    kinds = DOC[DOC.index("### Payload types"):DOC.index("## Admission control")]
    for content_type in (payloads.BYTES, payloads.TEXT, payloads.JSON, payloads.NPY):
        assert f"`{content_type}`" in kinds, content_type
    assert f"at most {payloads.MAX_NPY_DIMS} dimensions" in kinds
    assert f"`{p.FIELD_CANCEL}`" in cancel and p.owner_value("1-0", "bulk") == "1-0 bulk"


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**63 - 1),
       st.lists(st.tuples(st.sampled_from([lane.value for lane in p.Lane]),
                          st.sampled_from(["ok", *(code.value for code in ErrorCode)]),
                          st.none() | st.floats()), max_size=50))
def test_recent_records_packed_in_groups_are_byte_for_byte_the_single_ones(
        finished_ms: int, answers: list[tuple[str, str, float | None]]) -> None:
    """The worker packs a flush's recent-list records with pack_many; readers decode them
    as single records: the bytes must be the same."""
    assert p.RecentResult.pack_many(finished_ms, answers) == [
        p.RecentResult.pack(finished_ms, *answer) for answer in answers]


_OUTPUTS = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=10)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=2**16), st.text(), st.text(),
       st.integers(min_value=0, max_value=2**63 - 1),
       st.lists(st.tuples(st.text(min_size=1), _OUTPUTS,
                          st.dictionaries(st.sampled_from(p.TIMING_NAMES), st.floats())),
                max_size=4))
def test_a_batchs_ok_results_are_byte_for_byte_the_single_ones(
        batch_size: int, worker: str, model: str, finished_ms: int,
        answers: list[tuple[str, object, dict[str, float]]]) -> None:
    """The worker encodes a batch's ok results with ok_encoder (NOTE [ Ok results of a
    batch ]); clients decode them as any result: the bytes must be the same, and an output
    msgpack cannot carry raises without spoiling the answers after it."""
    encode = p.ResultEnvelope.ok_encoder(batch_size, worker, model, finished_ms)
    for request_id, output, timings in answers:
        with pytest.raises(TypeError):
            encode(request_id, {"x": object()}, timings)
        assert encode(request_id, output, timings) == p.ResultEnvelope(
            request_id, p.Status.OK, output, timings=timings, batch_size=batch_size,
            worker=worker, model=model, finished_ms=finished_ms).encode()


@pytest.mark.parametrize("missing", ["v", "model", "payload", "content_type", "submitted_ms",
                                     "deadline_ms", "lane", "params"])
def test_an_envelope_missing_any_field_is_a_bad_envelope(missing: str) -> None:
    body = {"v": 1, "model": "m", "payload": b"x", "content_type": "", "submitted_ms": 0,
            "deadline_ms": None, "lane": "bulk", "params": {}}
    del body[missing]
    with pytest.raises(ProtocolError) as raised:
        JobEnvelope.decode({b"rid": b"r1", b"job": msgpack.packb(body)}, 1024)
    assert raised.value.code is ErrorCode.BAD_ENVELOPE and raised.value.request_id == "r1"
    assert missing in raised.value.message
