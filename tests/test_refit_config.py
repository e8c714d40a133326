"""The refit config block: only a truly absent key defaults; everything else not exactly right is an error."""

from __future__ import annotations

import pickle
import types

import pytest
from pydantic import BaseModel, ValidationError

from wcviz import refit
from wcviz._errors import WcvizError
from wcviz.refit.config import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    RefitConfig,
    RefitConfigError,
    VerifyConfig,
    parse_refit_config,
    verify_mode,
)

MODES = ("off", "log", "enforce")
CHOICES = "'off', 'log', 'enforce'"
TOP_KEYS = "allowed keys: buffer_bytes, timeout_s, verify"


def error_of(data: object) -> str:
    with pytest.raises(RefitConfigError) as info:
        parse_refit_config(data)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "pydantic" not in msg and "validation error" not in msg.lower() and "Value error" not in msg
    return msg


# --- defaults: only what is truly absent --------------------------------------------------------------------


@pytest.mark.parametrize("data", [None, {}, types.MappingProxyType({})])
def test_absent_config_or_key_is_off(data):
    cfg = parse_refit_config(data)
    assert cfg == RefitConfig()
    assert cfg.verify.mode == "off"
    assert cfg.buffer_bytes == DEFAULT_BUFFER_BYTES == 256 * 1024 * 1024
    assert cfg.timeout_s == DEFAULT_TIMEOUT_S == 60.0


def test_empty_verify_block_takes_the_default_mode():
    # the block is present, its `mode` key is absent: absent keys default, at every level
    assert parse_refit_config({"verify": {}}).verify.mode == "off"
    assert VerifyConfig().mode == "off"


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_parses(mode):
    cfg = parse_refit_config({"verify": {"mode": mode}})
    assert cfg.verify == VerifyConfig(mode=mode)
    assert cfg.verify.mode == mode and type(cfg.verify.mode) is str


def test_exports_from_package():
    assert refit.RefitConfig is RefitConfig
    assert refit.VerifyConfig is VerifyConfig
    assert refit.RefitConfigError is RefitConfigError
    assert refit.parse_refit_config is parse_refit_config


def test_error_type():
    assert issubclass(RefitConfigError, WcvizError)
    assert issubclass(RefitConfigError, ValueError)


# --- explicit falsy values are errors, not "off" ------------------------------------------------------------

FALSY = [None, False, [], "", 0, 0.0, ()]


@pytest.mark.parametrize("value", FALSY, ids=repr)
def test_explicit_falsy_verify_is_an_error(value):
    msg = error_of({"verify": value})
    assert msg.startswith("invalid value for verify: ")
    assert f"verify: {value!r};" in msg
    assert CHOICES in msg


@pytest.mark.parametrize("value", FALSY, ids=repr)
def test_explicit_falsy_mode_is_an_error(value):
    msg = error_of({"verify": {"mode": value}})
    assert f"invalid value for verify.mode: {value!r}" in msg
    assert CHOICES in msg


@pytest.mark.parametrize("value", [None, False, [], "", 0])
def test_falsy_mode_fails_at_model_construction_too(value):
    with pytest.raises(ValidationError) as info:
        VerifyConfig(mode=value)
    assert "verify.mode" in str(info.value) and repr(value) in str(info.value) and CHOICES in str(info.value)
    with pytest.raises(ValidationError):
        RefitConfig(verify=value)
    with pytest.raises(ValidationError):
        RefitConfig.model_validate({"verify": {"mode": value}})


def test_verify_as_a_bare_string_is_an_error():
    msg = error_of({"verify": "log"})
    assert "'log'" in msg and "mapping such as {mode: 'log'}" in msg


@pytest.mark.parametrize("value, said", [(False, "off"), (True, "on")])
def test_yaml_boolean_mode_explains_the_quoting(value, said):
    # YAML 1.1 loaders (PyYAML) read `mode: off` as False: reject it, and say why
    msg = error_of({"verify": {"mode": value}})
    assert f"verify.mode: {value!r}" in msg and said in msg and "quote" in msg and CHOICES in msg


# --- misspelled modes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, meant",
    [
        ("lgo", "log"),
        ("logg", "log"),
        ("enfroce", "enforce"),
        ("enforced", "enforce"),
        ("of", "off"),
        ("Enforce", "enforce"),
        ("LOG", "log"),
        ("Off", "off"),
        (" log", "log"),
        ("log\n", "log"),
    ],
)
def test_misspelled_mode_is_rejected_with_a_suggestion(value, meant):
    msg = error_of({"verify": {"mode": value}})
    assert f"verify.mode: {value!r}" in msg
    assert f"(did you mean {meant!r}?)" in msg
    assert CHOICES in msg
    with pytest.raises(ValidationError, match="did you mean"):
        VerifyConfig(mode=value)


@pytest.mark.parametrize("value", ["on", "true", "strict", "xyz", 1, 2.5, ["log"], {"log": 1}, b"log"], ids=repr)
def test_unrelated_mode_values_name_the_choices(value):
    msg = error_of({"verify": {"mode": value}})
    assert f"verify.mode: {value!r}" in msg and CHOICES in msg
    assert "did you mean" not in msg


# --- unknown keys, at both levels ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, meant",
    [
        ("verfiy", "verify"),
        ("veriyf", "verify"),
        ("Verify", "verify"),
        ("verify_mode", "verify"),
        ("buffer_byte", "buffer_bytes"),
        ("bufferbytes", "buffer_bytes"),
        ("timeout", "timeout_s"),
        ("timout_s", "timeout_s"),
    ],
)
def test_unknown_top_key_suggests_the_nearest(key, meant):
    msg = error_of({key: {"mode": "log"}})
    assert msg == f"unknown key {key!r} in refit config (did you mean {meant!r}?); {TOP_KEYS}"


@pytest.mark.parametrize("key, meant", [("mdoe", "mode"), ("Mode", "mode"), ("modes", "mode"), ("mod", "mode")])
def test_unknown_verify_key_suggests_the_nearest(key, meant):
    msg = error_of({"verify": {key: "log"}})
    assert msg == f"unknown key {key!r} in verify (did you mean {meant!r}?); allowed keys: mode"


@pytest.mark.parametrize("key", ["algorithm", "enabled", 1, None])
def test_unknown_key_without_a_near_match(key):
    msg = error_of({"verify": {"mode": "log"}, key: 1})
    assert msg == f"unknown key {key!r} in refit config; {TOP_KEYS}"
    msg = error_of({"verify": {"mode": "log", key: 1}})
    assert msg == f"unknown key {key!r} in verify; allowed keys: mode"


def test_extra_field_next_to_a_valid_one_is_still_an_error():
    # a right key does not excuse a wrong one beside it, at either level
    assert "unknown key 'mdoe' in verify" in error_of({"verify": {"mode": "enforce", "mdoe": "log"}})
    assert "unknown key 'verfiy' in refit config" in error_of({"verify": {"mode": "enforce"}, "verfiy": {}})


def test_every_unknown_key_is_named():
    msg = error_of({"verfiy": 1, "timeout": 2})
    assert "unknown key 'verfiy' in refit config (did you mean 'verify'?)" in msg
    assert "unknown key 'timeout' in refit config (did you mean 'timeout_s'?)" in msg


@pytest.mark.parametrize("model, data", [(VerifyConfig, {"mdoe": "log"}), (RefitConfig, {"verfiy": {}})])
def test_extra_fields_forbidden_in_models(model, data):
    assert model.model_config["extra"] == "forbid"
    with pytest.raises(ValidationError, match="did you mean"):
        model(**data)
    with pytest.raises(ValidationError, match="did you mean"):
        model.model_validate(data)


@pytest.mark.parametrize("data", [["verify"], "verify: {mode: log}", 3, b"", True], ids=repr)
def test_refit_config_must_be_a_mapping(data):
    msg = error_of(data)
    assert f"refit config must be a mapping of buffer_bytes, timeout_s, verify; got {data!r}" == msg


# --- immutability -------------------------------------------------------------------------------------------


def test_frozen_at_every_level():
    cfg = parse_refit_config({"verify": {"mode": "log"}})
    with pytest.raises(ValidationError):
        cfg.verify = VerifyConfig(mode="enforce")  # type: ignore[misc]
    with pytest.raises(ValidationError):
        cfg.verify.mode = "enforce"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        cfg.timeout_s = 1.0  # type: ignore[misc]
    assert cfg.verify.mode == "log" and cfg.timeout_s == 60.0
    assert hash(cfg) == hash(parse_refit_config({"verify": {"mode": "log"}}))


def test_default_verify_block_is_not_shared_mutable_state():
    a, b = RefitConfig(), RefitConfig()
    with pytest.raises(ValidationError):
        a.verify.mode = "enforce"  # type: ignore[misc]
    assert b.verify.mode == "off"


# --- transport knobs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [512, 4096, 1 << 30, DEFAULT_BUFFER_BYTES])
def test_buffer_bytes_accepted(value):
    assert parse_refit_config({"buffer_bytes": value}).buffer_bytes == value


@pytest.mark.parametrize("value", [True, False, 0, -1, 511, 1.0, 4096.0, "4096", None, [4096]], ids=repr)
def test_buffer_bytes_rejected(value):
    msg = error_of({"buffer_bytes": value})
    assert msg == f"invalid value for buffer_bytes: {value!r}; it must be an integer number of bytes >= 512"


@pytest.mark.parametrize("value, want", [(1, 1.0), (0.5, 0.5), (600, 600.0), (1e-3, 1e-3)])
def test_timeout_accepted(value, want):
    cfg = parse_refit_config({"timeout_s": value})
    assert cfg.timeout_s == want and type(cfg.timeout_s) is float


TIMEOUT_RULE = "it must be a finite number of seconds > 0 and at most 2147483 (about 24.8 days)"


@pytest.mark.parametrize(
    "value", [True, False, 0, 0.0, -1, -0.5, float("nan"), float("inf"), "60", None, [60], 1e300, 2147484], ids=repr
)
def test_timeout_rejected(value):
    msg = error_of({"timeout_s": value})
    assert msg == f"invalid value for timeout_s: {value!r}; {TIMEOUT_RULE}"


def test_timeout_up_to_what_zmq_can_wait_is_accepted():
    """ZMQ's poll takes an int of milliseconds: the largest timeout is 2**31 - 1 ms, rounded down to a second."""
    assert parse_refit_config({"timeout_s": 2147483}).timeout_s == 2147483.0


@pytest.mark.parametrize("value", [-1, 0, float("inf"), float("nan"), 1e20, True], ids=repr)
def test_transports_refuse_a_timeout_zmq_or_gloo_cannot_honour(value):
    """A negative timeout made ZMQ wait forever (a hang); inf, NaN, 1e20 escaped as OverflowError/ValueError."""
    from datetime import timedelta

    from wcviz.refit import IPCReceiver, IPCSender, RefitConfigError
    from wcviz.refit._group import _timeout

    with pytest.raises(RefitConfigError, match=r"invalid value for timeout_s: .*finite number of seconds > 0"):
        IPCSender(verify="log", timeout_s=value)
    with pytest.raises(RefitConfigError, match="invalid value for timeout_s"):
        IPCReceiver("ipc:///nonexistent/x.sock", {}, lambda batch: None, timeout_s=value)
    if not isinstance(value, bool):
        with pytest.raises(RefitConfigError, match="invalid value for timeout_s"):
            _timeout(value)  # the broadcast transports' barrier timeout
    with pytest.raises(RefitConfigError, match="invalid value for timeout_s"):
        _timeout(timedelta(seconds=-1))
    assert _timeout(None) is None and _timeout(2.5) == timedelta(seconds=2.5)


def test_knobs_validated_at_model_construction():
    with pytest.raises(ValidationError, match="buffer_bytes: True"):
        RefitConfig(buffer_bytes=True)
    with pytest.raises(ValidationError, match="timeout_s: -1"):
        RefitConfig(timeout_s=-1)


def test_several_errors_in_one_message():
    msg = error_of({"verify": {"mode": "lgo"}, "buffer_bytes": -1, "timeout_s": 0})
    assert msg.startswith("3 errors in refit config:\n")
    assert "verify.mode: 'lgo' (did you mean 'log'?)" in msg
    assert "buffer_bytes: -1" in msg and "timeout_s: 0" in msg


# --- verify_mode ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_verify_mode_on_each_input_type(mode):
    assert verify_mode(mode) == mode
    assert verify_mode(VerifyConfig(mode=mode)) == mode
    assert verify_mode(RefitConfig(verify=VerifyConfig(mode=mode))) == mode
    assert verify_mode(parse_refit_config({"verify": {"mode": mode}})) == mode


def test_verify_mode_none_and_defaults_are_off():
    assert verify_mode(None) == "off"
    assert verify_mode(VerifyConfig()) == "off"
    assert verify_mode(RefitConfig()) == "off"


@pytest.mark.parametrize("value", ["lgo", "Enforce", "", False, 0, [], {"mode": "log"}], ids=repr)
def test_verify_mode_rejects_anything_else(value):
    with pytest.raises(RefitConfigError) as info:
        verify_mode(value)  # type: ignore[arg-type]
    msg = str(info.value)
    assert f"verify.mode: {value!r}" in msg and CHOICES in msg


def test_verify_mode_suggests():
    with pytest.raises(RefitConfigError, match=r"did you mean 'enforce'\?"):
        verify_mode("Enforce")


# --- a framework's section, end to end ------------------------------------------------------------------------


def framework_config(refit_section: object) -> dict:
    """What a framework's YAML loader hands over: nested plain dicts."""
    return {
        "policy": {
            "model_name": "tiny",
            "generation": {"backend": "vllm", "colocated": {"enabled": True}},
            "refit": refit_section,
        },
        "cluster": {"gpus_per_node": 8},
    }


def test_roundtrip_from_a_framework_section():
    section = {"verify": {"mode": "enforce"}, "buffer_bytes": 64 << 20, "timeout_s": 30}
    cfg = parse_refit_config(framework_config(section)["policy"]["refit"])
    assert cfg.verify.mode == "enforce" and cfg.buffer_bytes == 64 << 20 and cfg.timeout_s == 30.0
    dumped = cfg.model_dump()
    assert dumped == {"verify": {"mode": "enforce"}, "buffer_bytes": 64 << 20, "timeout_s": 30.0}
    assert parse_refit_config(dumped) == cfg
    assert RefitConfig.model_validate(dumped) == cfg
    assert RefitConfig.model_validate_json(cfg.model_dump_json()) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert parse_refit_config(cfg) is cfg


def test_section_absent_from_the_framework_config():
    policy = framework_config(None)["policy"]
    del policy["refit"]
    assert parse_refit_config(policy.get("refit")).verify.mode == "off"


def test_read_only_mappings_at_every_level():
    section = types.MappingProxyType({"verify": types.MappingProxyType({"mode": "log"})})
    assert parse_refit_config(section).verify.mode == "log"
    with pytest.raises(RefitConfigError, match="unknown key 'mdoe' in verify"):
        parse_refit_config(types.MappingProxyType({"verify": types.MappingProxyType({"mdoe": "log"})}))


def test_nests_inside_a_frameworks_own_pydantic_config():
    class Policy(BaseModel):
        refit: RefitConfig = RefitConfig()

    assert Policy().refit.verify.mode == "off"
    assert Policy.model_validate({"refit": {"verify": {"mode": "log"}}}).refit.verify.mode == "log"
    with pytest.raises(ValidationError) as info:
        Policy.model_validate({"refit": {"verify": {"mdoe": "log"}}})
    assert "unknown key 'mdoe' in verify (did you mean 'mode'?)" in str(info.value)
