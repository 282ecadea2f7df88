"""The per-family parts of the Hugging Face config import (hf_config._Importer calls them): the layer layout
(layer_types or the 1-based index lists), KDA, MLA, Block AttnRes, and the MLP / MoE sections. Each takes the
config's HFFields and returns its section of the YAML schema's plain data, recording where each field came from;
what transformers' KimiLinear would ignore or cannot run is refused with the field's file and line."""
from __future__ import annotations

from typing import Any

from .hf_scope import HFFields, _bool, _err, _int, _show
from .located import did_you_mean


def layer_kinds(f: HFFields, n: int) -> list[str]:
    lt_names = f.names("layer_types")
    full_names = f.names("full_attn_layers", lin=("full_attn_layers",))
    kda_names = f.names("kda_layers", lin=("kda_layers",))
    from_types = from_lists = None
    hit = f.r.find(lt_names)
    if hit is not None and hit[0].data[hit[1]] is not None:
        from_types = _from_layer_types(f, hit, n)
        f.r.record["layers.kinds"] = (hit[0].field(hit[1]), hit[0].key_line(hit[1]))
    full_hit, kda_hit = f.r.find(full_names), f.r.find(kda_names)
    given = [h for h in (full_hit, kda_hit) if h is not None]
    if given and not (f.kl and len(given) < 2):    # transformers' KimiLinear reads both lists or neither
        from_lists = _from_index_lists(f, full_hit, kda_hit, n)
        if from_types is None:
            f.r.record["layers.kinds"] = (given[0][0].field(given[0][1]), given[0][0].key_line(given[0][1]))
    if from_types is not None and from_lists is not None and from_types != from_lists:
        first = next(i for i in range(n) if from_types[i] != from_lists[i])
        where = full_hit or kda_hit
        raise where[0].error(where[1], f"disagrees with '{hit[0].field(hit[1])}' at layer {first + 1} "
                                       f"(1-based): {from_lists[first]} vs {from_types[first]}")
    kinds = from_types or from_lists
    if kinds is None:
        if not f.kl:
            scope = f.lin or f.t
            raise scope.error(None, "give the attention layout: 'full_attn_layers' (1-based MLA layers, in "
                                    "linear_attn_config or text_config) or 'layer_types'")
        # transformers' default: full attention at every 4th layer (0-based i % 4 == 0, i > 0)
        kinds = ["mla" if i and i % 4 == 0 else "kda" for i in range(n)]
    return kinds


def _from_layer_types(f: HFFields, hit, n: int) -> list[str]:
    scope, key = hit
    value = scope.data[key]
    if not isinstance(value, list):
        raise scope.error(key, f"must be a list, got {_show(value)}")
    if len(value) != n:
        raise scope.error(key, f"lists {len(value)} layers but num_hidden_layers is {n}")
    table = {"full_attention": "mla", "linear_attention": "kda"}
    kinds = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or item not in table:
            hint = did_you_mean(item, table) if isinstance(item, str) else ""
            raise scope.error(key, f"item {i} must be one of full_attention, linear_attention, got "
                                   f"{_show(item)}{hint}", scope.item_line(key, i))
        kinds.append(table[item])
    return kinds


def _from_index_lists(f: HFFields, full_hit, kda_hit, n: int) -> list[str]:
    def indices(hit) -> list[int]:
        scope, key = hit
        value = scope.data[key]
        if not isinstance(value, list):
            raise scope.error(key, f"must be a list of 1-based layer indices, got {_show(value)}")
        seen: list[int] = []
        for i, item in enumerate(value):
            line = scope.item_line(key, i)
            if isinstance(item, bool) or not isinstance(item, int):
                raise scope.error(key, f"item {i} must be a 1-based layer index, got {_show(item)}", line)
            if not 1 <= item <= n:
                raise scope.error(key, f"layer index {item} out of range 1..{n} (indices are 1-based)", line)
            if item in seen:
                raise scope.error(key, f"layer index {item} listed twice", line)
            seen.append(item)
        return [i - 1 for i in seen]

    full = indices(full_hit) if full_hit is not None else None
    kda = indices(kda_hit) if kda_hit is not None else None
    if full is not None and kda is not None:
        both = sorted(set(full) & set(kda))
        if both:
            raise kda_hit[0].error(kda_hit[1], f"layer {both[0] + 1} is in both full_attn_layers and "
                                               f"kda_layers")
        neither = sorted(set(range(n)) - set(full) - set(kda))
        if neither:
            raise kda_hit[0].error(kda_hit[1], f"layer {neither[0] + 1} is in neither full_attn_layers "
                                               f"nor kda_layers")
    if full is not None:
        return ["mla" if i in full else "kda" for i in range(n)]
    return ["kda" if i in kda else "mla" for i in range(n)]


def kda(f: HFFields) -> dict:
    heads = f.get("kda.num_heads", f.names("linear_num_heads", lin=("num_heads",)), f.dflt(32))
    head_dim = f.get("kda.head_dim", f.names("linear_head_dim", lin=("head_dim",)), f.dflt(128))
    conv = f.get("kda.conv_kernel", f.names("linear_conv_kernel_dim", lin=("short_conv_kernel_size",)),
                    f.dflt(4))
    lb_names = f.names("gate_lower_bound", "linear_lower_bound", lin=("gate_lower_bound",))
    safe_names = f.names("safe_gate", lin=("safe_gate",))
    full_names = f.names("use_full_rank_gate", lin=("use_full_rank_gate",))
    frank_names = f.names(lin=("forget_gate_rank",))
    orank_names = f.names(lin=("output_gate_rank",))
    if f.kl:
        f.reject_for_kimi_linear(lb_names, None, "a gate lower bound (safe gate)")
        f.reject_for_kimi_linear(safe_names, False, "the safe gate")
        f.reject_for_kimi_linear(full_names, False, "a full-rank output gate")
        f.reject_for_kimi_linear(frank_names, None, "a forget-gate rank")
        f.reject_for_kimi_linear(orank_names, None, "an output-gate rank")
        _hidden_act_for_conv(f)
    out: dict[str, Any] = {"num_heads": heads, "head_dim": head_dim, "conv_kernel": conv}
    lb = f.get("kda.gate_lower_bound", lb_names, None)
    safe_hit = f.r.find(safe_names)
    safe = _bool(safe_hit[0].data[safe_hit[1]], safe_hit, f.r, "safe_gate") if safe_hit else None
    if lb is None and safe:
        lb = -5.0                                      # GLM5-style configs: safe_gate without a bound = -5
        f.r.record["kda.gate"] = (safe_hit[0].field(safe_hit[1]), safe_hit[0].key_line(safe_hit[1]))
    if lb is not None and safe is False:
        raise safe_hit[0].error(safe_hit[1], "safe_gate is false but a gate_lower_bound is given")
    if lb is None:
        out["gate"] = "softplus"
    else:
        out["gate"] = "safe"
        out["gate_lower_bound"] = lb
        f.r.record.setdefault("kda.gate", f.r.record.get("kda.gate_lower_bound", ("", None)))
    full_hit = f.r.find(full_names)
    full = _bool(full_hit[0].data[full_hit[1]], full_hit, f.r, "use_full_rank_gate") if full_hit else False
    if full_hit:
        f.r.record["kda.output_gate"] = (full_hit[0].field(full_hit[1]), full_hit[0].key_line(full_hit[1]))
    # The forget gate (and the low-rank output gate) have rank head_dim in both Kimi Linear and K3.
    out["gate_rank"] = f.get("kda.gate_rank", frank_names, head_dim)
    out["output_gate"] = "full_rank" if full else "low_rank"
    if not full:
        out["output_gate_rank"] = f.get("kda.output_gate_rank", orank_names, head_dim)
    elif f.r.find(orank_names) is not None:
        scope, key = f.r.find(orank_names)
        raise scope.error(key, "only applies to a low-rank output gate (use_full_rank_gate is true)")
    return out


def _hidden_act_for_conv(f: HFFields) -> None:
    """transformers' KimiLinear applies config.hidden_act to the KDA short convolution too."""
    names = f.names("hidden_act")
    act = f.get(None, names, "silu")
    if act != "silu":
        scope, key = f.r.find(names)
        raise scope.error(key, f"hidden_act {_show(act)} is not supported for model_type kimi_linear "
                               f"(transformers applies it to the experts and to the KDA short convolution; "
                               f"only silu is supported)")


def mla(f: HFFields) -> dict:
    heads_names = f.names("num_attention_heads")
    heads = f.get("mla.num_heads", heads_names, f.dflt(32))
    kv_names = f.names("num_key_value_heads")
    kv = f.get(None, kv_names, None)
    if isinstance(heads, bool) or not isinstance(heads, int):
        raise _err(f.r, f.r.find(heads_names), "num_attention_heads",
                   f"must be an integer, got {_show(heads)}")
    if kv is not None and kv != heads:
        scope, key = f.r.find(kv_names)
        raise scope.error(key, f"num_key_value_heads {kv} differs from num_attention_heads {heads}; MLA "
                               f"decompresses one key and value per head (set them equal)")
    bias_names = f.names("attention_bias")
    if f.get(None, bias_names, False) not in (False, None):
        scope, key = f.r.find(bias_names)
        raise scope.error(key, "attention biases are not supported (K3 and Kimi Linear have none)")
    nope_names = f.names("mla_use_nope")
    nope = f.get("mla.rope", nope_names, True)
    if nope is not True:
        scope, key = f.r.find(nope_names)
        raise scope.error(key, f"must be true, got {_show(nope)}: k3c implements NoPE MLA only (the rope "
                               f"dims exist but are never rotated)")
    gate_names = f.names("mla_use_output_gate")
    f.reject_for_kimi_linear(gate_names, False, "an MLA output gate")
    gate = f.get("mla.output_gate", gate_names, False)
    return {"num_heads": heads,
            "q_lora_rank": f.get("mla.q_lora_rank", f.names("q_lora_rank"), None),
            "kv_lora_rank": f.get("mla.kv_lora_rank", f.names("kv_lora_rank"), f.dflt(512)),
            "qk_nope_head_dim": f.get("mla.qk_nope_head_dim", f.names("qk_nope_head_dim"),
                                         f.dflt(128)),
            "qk_rope_head_dim": f.get("mla.qk_rope_head_dim", f.names("qk_rope_head_dim"),
                                         f.dflt(64)),
            "v_head_dim": f.get("mla.v_head_dim", f.names("v_head_dim"), f.dflt(128)),
            "rope": "none", "output_gate": gate}


def attn_res(f: HFFields) -> Any:
    names = f.names("attn_res_block_size", "attention_residual_block_size", "block_attn_res_size")
    f.reject_for_kimi_linear(names, 0, "Block AttnRes")
    size = f.get("attn_res.block_size", names, None)
    if size is None or size == 0:
        return "off"
    return {"block_size": size}


def mlp(f: HFFields, n: int) -> tuple[dict, dict | None]:
    """The mlp section and the moe section (None when no layer is MoE)."""
    types = _mlp_layer_types(f, n)
    dense = [i for i in range(n) if types[i] == "dense"]
    any_moe = "sparse" in types
    activation = _activation(f)
    mlp: dict[str, Any] = {"dense_layers": dense, "activation": activation}
    if dense or not any_moe:
        mlp["dense_intermediate_size"] = f.get("mlp.dense_intermediate_size", f.names("intermediate_size"),
                                                  f.dflt(9216))
    mlp.update(_situ_betas(f, activation))
    _check_routing(f)
    return mlp, (_moe(f) if any_moe else None)


def _mlp_layer_types(f: HFFields, n: int) -> list[str]:
    """'dense' or 'sparse' (MoE) per layer: mlp_layer_types, or first_k_dense_replace with moe_layer_freq."""
    mlt_names = f.names("mlp_layer_types")
    fk_names = f.names("first_k_dense_replace")
    freq_names = f.names("moe_layer_freq")
    fk_hit, freq_hit = f.r.find(fk_names), f.r.find(freq_names)
    freq = _int(freq_hit, freq_hit[0].data[freq_hit[1]], f.r, "moe_layer_freq", hi=4096) if freq_hit else 1
    if f.kl and freq != 1:
        raise freq_hit[0].error(freq_hit[1], "transformers' KimiLinear ignores moe_layer_freq (every layer "
                                             "after first_k_dense_replace is MoE); only 1 is supported")
    fk = _int(fk_hit, fk_hit[0].data[fk_hit[1]], f.r, "first_k_dense_replace", lo=0, hi=n) if fk_hit else 1
    from_freq = ["dense" if i < fk or i % freq != 0 else "sparse" for i in range(n)]
    hit = f.r.find(mlt_names)
    if hit is None or hit[0].data[hit[1]] is None:
        if not f.kl and fk_hit is None:
            raise f.t.error(None, "missing required field 'first_k_dense_replace' (or 'mlp_layer_types')")
        where = fk_hit or freq_hit
        if where:
            f.r.record["mlp.dense_layers"] = (where[0].field(where[1]), where[0].key_line(where[1]))
        return from_freq
    scope, key = hit
    value = scope.data[key]
    if not isinstance(value, list) or len(value) != n:
        raise scope.error(key, f"must be a list of {n} entries 'dense' or 'sparse', got {_show(value)}")
    for i, item in enumerate(value):
        if item not in ("dense", "sparse"):
            raise scope.error(key, f"item {i} must be dense or sparse, got {_show(item)}", scope.item_line(key, i))
    if (fk_hit or freq_hit) and list(value) != from_freq:
        other = fk_hit or freq_hit
        raise other[0].error(other[1], f"disagrees with '{scope.field(key)}'")
    f.r.record["mlp.dense_layers"] = (scope.field(key), scope.key_line(key))
    return list(value)


def _activation(f: HFFields) -> str:
    """The schema's MLP activation (swiglu or situ) that hidden_act names."""
    act_names = f.names("hidden_act")
    act = f.get("mlp.activation", act_names, "silu")
    acts = {"silu": "swiglu", "swiglu": "swiglu", "situ": "situ"}
    if not isinstance(act, str) or act not in acts or (f.kl and act != "silu"):
        scope, key = f.r.find(act_names)
        options = "silu" if f.kl else "silu, situ"
        raise scope.error(key, f"unsupported hidden_act {_show(act)}; supported: {options}")
    return acts[act]


def _situ_betas(f: HFFields, activation: str) -> dict:
    """SiTU's betas (situ_betas = [gate, up], or situ_beta_gate / situ_beta_up); SwiGLU refuses them."""
    beta_pair = f.names("situ_betas", "hidden_act_betas")
    beta_g = f.names("situ_beta_gate")
    beta_u = f.names("situ_beta_up")
    if activation != "situ":
        for names in (beta_pair, beta_g, beta_u):
            hit = f.r.find(names)
            if hit is not None:
                raise hit[0].error(hit[1], "only applies to hidden_act situ")
        return {}
    pair_hit = f.r.find(beta_pair)
    if pair_hit is None:
        return {"situ_beta_gate": f.get("mlp.situ_beta_gate", beta_g, 4.0),
                "situ_beta_up": f.get("mlp.situ_beta_up", beta_u, 25.0)}
    scope, key = pair_hit
    pair = scope.data[key]
    if not isinstance(pair, list) or len(pair) != 2:
        raise scope.error(key, f"must be a list [beta_gate, beta_up], got {_show(pair)}")
    if f.r.find(beta_g) or f.r.find(beta_u):
        raise scope.error(key, "give either situ_betas or situ_beta_gate/situ_beta_up, not both")
    f.r.record["mlp.situ_beta_gate"] = f.r.record["mlp.situ_beta_up"] = (scope.field(key),
                                                                                scope.key_line(key))
    return {"situ_beta_gate": pair[0], "situ_beta_up": pair[1]}


def _check_routing(f: HFFields) -> None:
    """Refuse expert routing k3c does not run: LatentMoE under kimi_linear, grouped (n_group > 1) routing."""
    f.reject_for_kimi_linear(f.latent_names, None, "LatentMoE (routed_expert_hidden_size)")
    f.reject_for_kimi_linear(f.latent_norm_names, False, "LatentMoE's norm")
    group_names = f.names("n_group", "num_expert_group")
    topk_group_names = f.names("topk_group")
    groups = f.get(None, group_names, 1, null_is_default=True)
    topk_group = f.get(None, topk_group_names, groups, null_is_default=True)
    ghit = f.r.find(group_names)
    groups = _int(ghit, groups, f.r, "n_group", hi=1 << 16)
    if groups > 1 and topk_group != groups:
        raise ghit[0].error(ghit[1], f"grouped expert routing ({groups} groups, topk_group {topk_group}) is "
                                     f"not supported: k3c routes over all experts (set n_group 1)")


def _moe(f: HFFields) -> dict:
    n_exp = f.get("moe.num_experts", f.names("n_routed_experts", "num_experts", "num_local_experts"),
                     f.dflt(256))
    top_k = f.get("moe.top_k", f.names("num_experts_per_tok", "num_experts_per_token"), f.dflt(8))
    shared = f.get("moe.num_shared_experts", f.names("n_shared_experts", "num_shared_experts"),
                      f.dflt(1, 0))
    inter = f.get("moe.expert_intermediate_size", f.names("moe_intermediate_size"), f.dflt(1024))
    router_names = f.names("moe_router_activation_func", "scoring_func")
    router = f.get("moe.router_activation", router_names, "sigmoid")
    if f.kl and router != "sigmoid":
        scope, key = f.r.find(router_names)
        raise scope.error(key, f"transformers' KimiLinear always routes with sigmoid scores, got "
                               f"{_show(router)}")
    moe: dict[str, Any] = {
        "num_experts": n_exp, "top_k": top_k, "num_shared_experts": shared,
        "expert_intermediate_size": inter,
        "latent_dim": f.get("moe.latent_dim", f.latent_names, None),
        "latent_norm": f.get("moe.latent_norm", f.latent_norm_names, False),
        "router_activation": router,
        "router_bias": f.get("moe.router_bias", f.names("moe_router_bias"), True),
        "renormalize": f.get("moe.renormalize", f.names("norm_topk_prob", "moe_renormalize"), True),
        "routed_scaling_factor": f.get("moe.routed_scaling_factor", f.names("routed_scaling_factor"),
                                          f.dflt(2.446, 1.0)),
    }
    shared_size = f.get("moe.shared_intermediate_size", f.names("shared_expert_intermediate_size"), None)
    if shared_size is not None:
        f.reject_for_kimi_linear(f.names("shared_expert_intermediate_size"), None,
                                    "an explicit shared-expert width")
        moe["shared_intermediate_size"] = shared_size
    return moe
