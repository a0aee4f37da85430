"""Which W4A16 checkpoint a config.json's `quantization_config` describes, and whether pdserve
can serve it. Formats (vLLM's names):

    awq                 AutoAWQ: {"quant_method": "awq", "bits": 4 ("w_bit"), "group_size"
                        ("q_group_size"), "zero_point", "version": "gemm"}
    gptq                AutoGPTQ / GPTQModel: {"quant_method": "gptq", "bits": 4, "group_size",
                        "desc_act", "sym", "checkpoint_format": "gptq" (v1, zeros stored minus
                        one) or "gptq_v2"}; act-order (desc_act) through g_idx
    compressed-tensors  llm-compressor's W4A16: format "pack-quantized", config_groups whose
                        weights are {num_bits: 4, type: int, strategy: group | channel,
                        group_size, symmetric, actorder}, no input activations

group_size -1 (and the channel strategy) is one group of the whole input dimension. Anything
else (other bit widths, AWQ gemv / exllama / marlin layouts, per-module overrides, a quantized
lm_head) is a ValueError naming the field and the format.
"""

from __future__ import annotations

from typing import Any

COMPRESSED_TENSORS = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
W4A16_METHODS = ("awq", "gptq", COMPRESSED_TENSORS)  # EngineConfig.quantization values


def w4a16_format(qc: dict[str, Any] | None) -> str | None:
    """"awq", "gptq" or "compressed-tensors" for a W4A16 checkpoint pdserve serves; None for
    none or another kind (FP8: engine/quant/fp8_checkpoint.py); ValueError for an AWQ, GPTQ or
    pack-quantized checkpoint pdserve cannot serve."""
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "awq":
        _check_awq(qc)
    elif method == "gptq":
        _check_gptq(qc)
    elif method == COMPRESSED_TENSORS and _is_pack_quantized(qc):
        _check_compressed_tensors(qc)
    else:
        return None
    return method


def _field(qc: dict[str, Any], fmt: str, *names: str) -> Any:
    for name in names:
        if name in qc:
            return qc[name]
    raise ValueError(f"quantization_config.{names[0]} is missing (quant_method {fmt!r})")


def _check_bits_and_group(qc: dict[str, Any], fmt: str, bits: tuple[str, ...],
                          group: tuple[str, ...]) -> None:
    value = _field(qc, fmt, *bits)
    if value != 4:
        raise ValueError(f"quantization_config.{bits[0]} {value} (quant_method {fmt!r}) is not "
                         "supported: 4-bit weights only")
    size = _field(qc, fmt, *group)
    if not isinstance(size, int) or (size != -1 and (size <= 0 or size % 8)):
        raise ValueError(f"quantization_config.{group[0]} {size!r} (quant_method {fmt!r}) is "
                         "not supported: -1 or a positive multiple of 8")


def _check_awq(qc: dict[str, Any]) -> None:
    _check_bits_and_group(qc, "awq", ("bits", "w_bit"), ("group_size", "q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r} (quant_method 'awq') is not "
                         "supported: the gemm layout only")


def _check_gptq(qc: dict[str, Any]) -> None:
    _check_bits_and_group(qc, "gptq", ("bits",), ("group_size",))
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r} (quant_method 'gptq') "
                         "is not supported (gptq or gptq_v2)")
    if qc.get("dynamic"):
        raise ValueError("quantization_config.dynamic (quant_method 'gptq'): per-module "
                         "overrides are not supported")
    if qc.get("lm_head"):
        raise ValueError("quantization_config.lm_head true (quant_method 'gptq'): a quantized "
                         "lm_head is not supported")


def gptq_zero_offset(qc: dict[str, Any]) -> int:
    """What GPTQ adds to a stored zero: 1 in the v1 format (it stores zero - 1), 0 in v2."""
    return 0 if qc.get("checkpoint_format") == "gptq_v2" else 1


def _is_pack_quantized(qc: dict[str, Any]) -> bool:
    groups = qc.get("config_groups") or {}
    formats = {qc.get("format")} | {g.get("format") for g in groups.values()}
    return PACK_QUANTIZED in formats


def _check_compressed_tensors(qc: dict[str, Any]) -> None:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty (compressed-tensors)")
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != PACK_QUANTIZED:
            raise ValueError(f"{where}.format {fmt!r} (compressed-tensors): pdserve serves "
                             f"{PACK_QUANTIZED} W4A16 groups only, not mixed with others")
        if group.get("input_activations") is not None:
            raise ValueError(f"{where}.input_activations (compressed-tensors {PACK_QUANTIZED}):"
                             " only weight-only W4A16 is supported")
        _check_ct_weights(group.get("weights") or {}, f"{where}.weights")


def _check_ct_weights(args: dict[str, Any], where: str) -> None:
    kind = (args.get("num_bits"), args.get("type"))
    if kind != (4, "int"):
        raise ValueError(f"{where}: num_bits {kind[0]} type {kind[1]!r} (compressed-tensors "
                         f"{PACK_QUANTIZED}) is not supported: num_bits 4, type int")
    strategy = args.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"{where}.strategy {strategy!r} (compressed-tensors {PACK_QUANTIZED})"
                         " is not supported (group or channel)")
    size = args.get("group_size")
    if strategy == "group" and (not isinstance(size, int) or size <= 0 or size % 8):
        raise ValueError(f"{where}.group_size {size!r} (compressed-tensors {PACK_QUANTIZED}) "
                         "is not supported: a positive multiple of 8")
    if args.get("dynamic"):
        raise ValueError(f"{where}.dynamic true (compressed-tensors {PACK_QUANTIZED}) is not "
                         "supported: static weight scales")
    if args.get("actorder") not in (None, False, True, "group", "weight", "static"):
        raise ValueError(f"{where}.actorder {args['actorder']!r} (compressed-tensors) is not "
                         "supported")
