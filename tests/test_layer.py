"""The resolver's inputs: LayerSpec, Requirements and SelectionConfig validators."""

from __future__ import annotations

import attrs
import pytest

import attnres
from attnres import Backend, LayerSpec, Requirements, Role, SelectionConfig
from attnres._vocab import DTYPES
from attnres.errors import UnknownBackendError

# -- LayerSpec: head size -------------------------------------------------------


@pytest.mark.parametrize("head_size", [0, -1, -128])
def test_head_size_below_one_is_rejected_naming_the_field(head_size: int) -> None:
    with pytest.raises(ValueError, match=r"^head_size: must be at least 1"):
        LayerSpec(head_size, "bf16")


@pytest.mark.parametrize("head_size", [True, False])
def test_bool_head_size_is_rejected(head_size: bool) -> None:
    with pytest.raises(ValueError, match=r"^head_size: expected a positive integer"):
        LayerSpec(head_size, "bf16")


@pytest.mark.parametrize("head_size", [64.0, "64", None])
def test_non_int_head_size_is_rejected(head_size: object) -> None:
    with pytest.raises(ValueError, match=r"^head_size: expected a positive integer"):
        LayerSpec(head_size, "bf16")  # type: ignore[arg-type]


def test_head_size_one_is_accepted() -> None:
    assert LayerSpec(1, "fp32").head_size == 1


# -- LayerSpec: dtype -----------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("double", "float64"),
        ("fp8", "float8_e4m3fn"),
        ("torch.bfloat16", "bfloat16"),
        (" float16 ", "float16"),
    ],
)
def test_dtype_aliases_normalise(given: str, canonical: str) -> None:
    assert LayerSpec(64, given).dtype == canonical


def test_torch_dtype_is_accepted() -> None:
    torch = pytest.importorskip("torch")
    assert LayerSpec(64, torch.bfloat16).dtype == "bfloat16"
    assert LayerSpec(64, torch.float16).dtype == "float16"
    assert LayerSpec(64, torch.float32).dtype == "float32"


@pytest.mark.parametrize("dtype", DTYPES)
def test_canonical_dtypes_are_kept(dtype: str) -> None:
    assert LayerSpec(64, dtype).dtype == dtype


@pytest.mark.parametrize("dtype", ["int8", "bfloat17", "", "torch.int32"])
def test_unknown_dtype_is_rejected_naming_the_field_and_the_valid_ones(dtype: str) -> None:
    with pytest.raises(ValueError, match=r"^dtype: unknown dtype") as info:
        LayerSpec(64, dtype)
    assert "bfloat16" in str(info.value)
    assert "float16" in str(info.value)


# -- LayerSpec: backends ----------------------------------------------------------


def test_supported_accepts_strings_backends_and_aliases() -> None:
    layer = LayerSpec(64, "bf16", supported={"FA", Backend.parse("torch_sdpa"), "sdpa"})
    assert layer.supported == frozenset({Backend("fa"), Backend("torch_sdpa")})


def test_supported_single_string_is_one_backend() -> None:
    assert LayerSpec(64, "bf16", supported="flash_attn").supported == frozenset({Backend("fa")})


def test_supported_none_means_no_constraint() -> None:
    assert LayerSpec(64, "bf16").supported is None


def test_empty_supported_set_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^supported: an empty set admits no backend"):
        LayerSpec(64, "bf16", supported=set())


def test_unknown_backend_in_supported_names_the_field() -> None:
    with pytest.raises(UnknownBackendError, match=r"^supported: Unknown attention backend") as i:
        LayerSpec(64, "bf16", supported={"fa", "flsh_attn"})
    assert isinstance(i.value, ValueError)
    assert i.value.name == "flsh_attn"


def test_unknown_backend_in_default_names_the_field() -> None:
    with pytest.raises(UnknownBackendError, match=r"^default: Unknown attention backend 'sag'"):
        LayerSpec(64, "bf16", default="sag")


def test_default_accepts_alias() -> None:
    assert LayerSpec(64, "bf16", default="SDPA").default == Backend("torch_sdpa")


def test_non_string_backend_in_supported_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^supported:"):
        LayerSpec(64, "bf16", supported=[3])  # type: ignore[list-item]


# -- LayerSpec: role, name, requirements ---------------------------------------------


@pytest.mark.parametrize(
    ("given", "role"),
    [("self", Role.SELF), ("cross", Role.CROSS), ("CROSS", Role.CROSS), (Role.CROSS, Role.CROSS)],
)
def test_role_strings_parse(given: object, role: Role) -> None:
    assert LayerSpec(64, "bf16", role=given).role is role  # type: ignore[arg-type]


def test_role_defaults_to_self() -> None:
    assert LayerSpec(64, "bf16").role is Role.SELF


@pytest.mark.parametrize("role", ["both", "", 1, None])
def test_bad_role_is_rejected(role: object) -> None:
    with pytest.raises(ValueError, match=r"role must be 'self' or 'cross'"):
        LayerSpec(64, "bf16", role=role)  # type: ignore[arg-type]


def test_name_must_be_a_string() -> None:
    assert LayerSpec(64, "bf16", name="blocks.0.attn1").name == "blocks.0.attn1"
    with pytest.raises(ValueError, match=r"^name: expected a string"):
        LayerSpec(64, "bf16", name=3)  # type: ignore[arg-type]


def test_layer_requirements_from_names() -> None:
    layer = LayerSpec(64, "bf16", requirements=["causal", "packed_varlen"])
    assert layer.requirements == Requirements(causal=True, packed_varlen=True)


def test_layer_spec_is_frozen_and_hashable() -> None:
    a = LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}, name="x")
    b = LayerSpec(64, "bfloat16", supported=["torch_sdpa", "fa"], name="x")
    assert a == b
    assert hash(a) == hash(b)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.head_size = 32  # type: ignore[misc]


# -- Requirements -----------------------------------------------------------------


def test_requirements_default_to_nothing_needed() -> None:
    assert Requirements().needed() == ()


def test_requirements_of_names() -> None:
    req = Requirements.of(["causal", "GQA", " attn_mask "])
    assert req == Requirements(causal=True, gqa=True, attn_mask=True)
    assert [r.value for r in req.needed()] == ["causal", "attn_mask", "gqa"]


def test_requirements_of_comma_string() -> None:
    assert Requirements.of("causal,dropout") == Requirements(causal=True, dropout=True)


def test_requirements_of_none_and_instance() -> None:
    inst = Requirements(packed_varlen=True)
    assert Requirements.of(None) == Requirements()
    assert Requirements.of(inst) is inst


def test_requirements_of_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown requirement 'varlen'") as info:
        Requirements.of(["causal", "varlen"])
    for name in ("causal", "attn_mask", "packed_varlen", "gqa", "dropout"):
        assert name in str(info.value)


def test_requirements_needed_canonical_order() -> None:
    req = Requirements(dropout=True, causal=True, packed_varlen=True)
    assert [r.value for r in req.needed()] == ["causal", "packed_varlen", "dropout"]


# -- SelectionConfig --------------------------------------------------------------


def test_selection_config_defaults() -> None:
    cfg = SelectionConfig()
    assert cfg.global_backend is None
    assert cfg.global_backend_explicit is True
    assert cfg.forced_backend is None
    assert cfg.component_backends == ()


def test_selection_config_parses_backend_names() -> None:
    cfg = SelectionConfig(global_backend="SAGE", forced_backend="flash_attn")
    assert cfg.global_backend == Backend("sage_attn")
    assert cfg.forced_backend == Backend("fa")


def test_selection_config_unknown_global_backend_names_the_field() -> None:
    with pytest.raises(UnknownBackendError, match=r"^global_backend: .*Did you mean 'sage_attn'"):
        SelectionConfig(global_backend="sage_atn")


def test_selection_config_unknown_forced_backend_names_the_field() -> None:
    with pytest.raises(UnknownBackendError, match=r"^forced_backend: "):
        SelectionConfig(forced_backend="nope_attn")


def test_selection_config_component_backends_from_mapping_and_pairs() -> None:
    a = SelectionConfig(component_backends={"vae": "sdpa", "text_encoder": "eager"})
    b = SelectionConfig(component_backends=[("text_encoder", "eager"), ("vae", "torch_sdpa")])
    assert a == b
    assert a.component_backends == (
        ("text_encoder", Backend("eager")),
        ("vae", Backend("torch_sdpa")),
    )
    assert a.component_backend("vae") == Backend("torch_sdpa")
    assert a.component_backend("transformer") is None
    assert a.component_backend(None) is None


def test_selection_config_component_backends_unknown_backend_names_the_component() -> None:
    with pytest.raises(UnknownBackendError, match=r"^component_backends\['vae'\]: "):
        SelectionConfig(component_backends={"vae": "sdpaa_x"})


@pytest.mark.parametrize("bad", [[("vae",)], [(3, "fa")], [("", "fa")]])
def test_selection_config_component_backends_malformed(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^component_backends: "):
        SelectionConfig(component_backends=bad)


def test_selection_config_explicit_flag_is_a_bool() -> None:
    cfg = SelectionConfig(global_backend="fa", global_backend_explicit=False)
    assert cfg.global_backend_explicit is False
    # strict: bool("no") would be True, silently turning the flag on
    for bad in (0, "no", None):
        with pytest.raises(ValueError, match=r"^global_backend_explicit: expected True or False"):
            SelectionConfig(global_backend="fa", global_backend_explicit=bad)


@pytest.mark.parametrize("field", ["causal", "attn_mask", "packed_varlen", "gqa", "dropout"])
def test_requirements_flags_are_strict_bools(field: str) -> None:
    assert getattr(Requirements(**{field: True}), field) is True
    with pytest.raises(ValueError, match=rf"^{field}: expected True or False, got 'yes'"):
        Requirements(**{field: "yes"})


def test_selection_config_is_hashable_and_equal_by_value() -> None:
    a = SelectionConfig(global_backend="fa", global_backend_explicit=False)
    b = SelectionConfig(global_backend="flash_attn", global_backend_explicit=False)
    assert a == b
    assert hash(a) == hash(b)
    assert a != SelectionConfig(global_backend="fa")


def test_set_selection_config_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="SelectionConfig"):
        attnres.set_selection_config({"global_backend": "fa"})  # type: ignore[arg-type]


def test_set_selection_config_returns_previous_and_is_used_by_resolve() -> None:
    cfg = SelectionConfig(global_backend="eager")
    previous = attnres.set_selection_config(cfg)
    assert previous == SelectionConfig()
    assert attnres.selection_config() is cfg
    res = attnres.resolve(LayerSpec(64, "fp32"), platform=attnres.Platform.simulate("cpu"))
    assert (res.backend.name, res.origin, res.reason) == ("eager", "global_cli", None)
