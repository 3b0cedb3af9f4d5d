"""The accelerator and precision catalog: typed, validated specs loaded from data/.

`load_catalog(price_table="modal")` reads `data/accelerators.toml` and `data/precisions.toml` and
returns a `Catalog`: accelerators (memory, bandwidth, dense TFLOP/s per format, link, cold start,
default efficiency factors, the selected table's price), precisions (bytes per weight including
scales, native / emulable architectures) and KV-cache dtypes. A price table may have a spot table
(`[spot.<table>]`: per accelerator a spot / preemptible USD per GPU-hour and a preemption rate per
replica-hour, sourced and dated like every price; `Catalog.spot`). A bad file names the field, the
value and what is allowed; an unknown name lists the known ones. Whether a (accelerator, precision)
pair runs natively, emulated, or not at all is decided here (`Catalog.support`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.tomlread import (
    check_keys,
    get_bool,
    get_float,
    get_int,
    get_str,
    get_str_list,
    get_table,
    normalize_name,
    read_toml,
)

ARCHS = ("ampere", "hopper", "blackwell", "cpu")
KINDS = ("gpu", "cpu")
COMPUTES = ("bf16", "fp8", "fp4", "fp32")
SERVERS = ("engine", "sglang")     # the samplers a format may name in `servers` (see data/precisions.toml)
TP_SIZES = (1, 2, 4, 8)
Support = Literal["native", "emulated", "unsupported"]

_DEFAULTABLE = ("eff_bw", "eff_flops", "decode_overhead_s", "prefill_overhead_s", "mem_util", "reserve_gb",
                "load_gb_s", "network_gb_s", "link_latency_s", "trainer_mfu", "trainer_overhead_s", "max_tp")


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One accelerator type, priced from the catalog's selected price table."""

    name: str
    kind: str                          # "gpu" | "cpu"
    arch: str                          # ampere | hopper | blackwell | cpu
    memory_gb: float                   # usable device memory per GPU, GB (1e9 bytes)
    bandwidth_tb_s: float              # peak memory bandwidth per GPU, TB/s
    tflops_bf16: float                 # dense tensor TFLOP/s; 0 = not native
    tflops_fp8: float
    tflops_fp4: float
    tflops_fp32: float                 # only used where no BF16 tensor cores (the CPU)
    link: str                          # scale-up link name
    link_gb_s: float                   # scale-up link bandwidth per GPU, GB/s (TP all-reduce)
    link_latency_s: float              # per all-reduce
    network_gb_s: float                # per GPU to other machines (weight sync), GB/s
    cold_start_s: float                # container + engine start before weights load, s
    load_gb_s: float                   # weight loading at cold start, GB/s per GPU
    max_tp: int                        # largest TP size per replica considered
    eff_bw: float                      # default achieved / peak bandwidth
    eff_flops: float                   # default achieved / peak FLOP/s
    decode_overhead_s: float           # fixed cost per decode step
    prefill_overhead_s: float          # fixed cost per prefill call
    mem_util: float                    # share of memory an engine may claim
    reserve_gb: float                  # per GPU, not for weights or KV
    trainer_mfu: float                 # default MFU when this accelerator trains
    trainer_overhead_s: float          # per trainer update
    price_usd_per_gpu_hour: float      # from the selected price table
    price_table: str
    price_estimate: bool               # True when that price is our estimate
    estimate: bool = False             # True when the hardware numbers are estimates
    source: str = ""
    date: str = ""
    spot_usd_per_gpu_hour: float | None = None  # the table's spot / preemptible price (None: no spot capacity)
    spot_preemptions_per_hour: float = 0.0      # preemptions per replica-hour at that spot price
    spot_estimate: bool = False                 # True when the spot figures are estimates
    spot: bool = False                          # this record is priced at the spot price (`Catalog.spot`)

    def peak_tflops(self, compute: str) -> float:
        """Dense TFLOP/s for a compute format name ('bf16', 'fp8', 'fp4', 'fp32')."""
        if compute not in COMPUTES:
            raise SpecError(f"accelerator '{self.name}'", "compute", compute, COMPUTES)
        return float(getattr(self, f"tflops_{compute}"))

    @property
    def emulation_tflops(self) -> float:
        """Peak used when a format is emulated: BF16 tensor cores, else FP32 (the CPU)."""
        return self.tflops_bf16 if self.tflops_bf16 > 0 else self.tflops_fp32

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_tb_s * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


@dataclass(frozen=True, kw_only=True)
class Precision:
    """A weight format: bytes per weight with scales, where it runs natively or emulated."""

    name: str
    description: str
    weight_bits: int
    scale_bits_per_weight: float
    keep_bytes_per_weight: float       # embeddings / LM head / router stay in this many bytes
    compute: str                       # accelerator TFLOP/s column when native
    native_arch: tuple[str, ...]
    emulable_arch: tuple[str, ...]
    emulation_slowdown: float          # step-time multiplier when emulated (>= 1)
    requant_passes: float              # memory passes over BF16 weights to convert at weight sync
    format: str = ""
    scales: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()      # samplers that serve it: "engine" (embedded), "sglang"
    sglang_quantization: str = ""      # SGLang's --quantization value ("" = none), when "sglang" serves it
    kernel: bool = False               # the embedded engine may compute (matmul) in this dtype
    source: str = ""
    date: str = ""

    @property
    def bytes_per_weight(self) -> float:
        """Bytes per quantized weight, scales included."""
        return (self.weight_bits + self.scale_bits_per_weight) / 8.0


@dataclass(frozen=True, kw_only=True)
class KVDtype:
    """A KV-cache storage format."""

    name: str
    description: str
    bytes_per_element: float
    servers: tuple[str, ...] = ()      # samplers that serve it: "engine" (embedded), "sglang"
    sglang_kv_cache_dtype: str = ""    # SGLang's --kv-cache-dtype value, when "sglang" serves it
    source: str = ""
    date: str = ""


@dataclass(frozen=True, kw_only=True)
class Catalog:
    """Accelerators (priced from one price table), precisions and KV dtypes, looked up by name."""

    accelerators: MappingProxyType[str, Accelerator]
    precisions: MappingProxyType[str, Precision]
    kv_dtypes: MappingProxyType[str, KVDtype]
    price_table: str                               # the selected table
    price_table_names: tuple[str, ...] = field(default=())
    price_table_source: str = ""
    price_table_date: str = ""
    spot_source: str = ""                          # the selected table's [spot.<table>] source and date
    spot_date: str = ""

    def accelerator(self, name: str | Accelerator) -> Accelerator:
        if isinstance(name, Accelerator):
            return name
        return _lookup("catalog", "accelerator", name, self.accelerators)

    def precision(self, name: str | Precision) -> Precision:
        if isinstance(name, Precision):
            return name
        return _lookup("catalog", "precision", name, self.precisions)

    def kv_dtype(self, name: str | KVDtype) -> KVDtype:
        if isinstance(name, KVDtype):
            return name
        return _lookup("catalog", "kv_dtype", name, self.kv_dtypes)

    def price_tables(self) -> tuple[str, ...]:
        """Names of the price tables in accelerators.toml (select one with load_catalog)."""
        return self.price_table_names

    def support(self, accelerator: str | Accelerator, precision: str | Precision) -> Support:
        """'native' (tensor cores for the format), 'emulated' (served by dequantizing) or 'unsupported'."""
        acc, prec = self.accelerator(accelerator), self.precision(precision)
        if acc.arch in prec.native_arch:
            return "native"
        if acc.arch in prec.emulable_arch:
            return "emulated"
        return "unsupported"

    def with_prices(self, prices: Mapping[str, float] | None) -> Catalog:
        """This catalog with some accelerators' USD per GPU-hour replaced (a negotiated or another cloud's
        price; `price_table` of those becomes "override"). An unknown accelerator lists the known ones; a
        price must be a number > 0."""
        if not prices:
            return self
        accs = dict(self.accelerators)
        for name, usd in prices.items():
            acc = self.accelerator(name)
            if isinstance(usd, bool) or not isinstance(usd, int | float) or not math.isfinite(usd) or usd <= 0:
                raise SpecError("prices", acc.name, usd, "USD per GPU-hour, a number > 0")
            accs[acc.name] = replace(acc, price_usd_per_gpu_hour=float(usd), price_table="override",
                                     price_estimate=False)
        return replace(self, accelerators=MappingProxyType(accs))

    def spot(self, name: str | Accelerator) -> Accelerator:
        """The accelerator priced at this table's spot price (`spot = True`, `price_table` "<table>-spot"); an
        accelerator without a spot price in this table is refused, naming those that have one."""
        acc = self.accelerator(name)
        if acc.spot:
            return acc
        if acc.spot_usd_per_gpu_hour is None:
            have = self.spot_accelerators()
            none = f"none (data/accelerators.toml has no [spot.{self.price_table}])"
            raise SpecError("catalog", "spot", acc.name, f"an accelerator with a spot price in price table "
                            f"'{self.price_table}': " + (", ".join(have) if have else none))
        return replace(acc, price_usd_per_gpu_hour=acc.spot_usd_per_gpu_hour, price_table=f"{self.price_table}-spot",
                       price_estimate=acc.spot_estimate, spot=True)

    def spot_accelerators(self) -> list[str]:
        """Accelerators with a spot price in the selected table."""
        return [n for n, a in self.accelerators.items() if a.spot_usd_per_gpu_hour is not None]

    def native_accelerators(self, precision: str | Precision) -> list[str]:
        """Accelerators that run the precision natively."""
        return [a for a in self.accelerators if self.support(a, precision) == "native"]

    def gpus(self) -> list[str]:
        """Names of the GPU accelerators (the catalog without the CPU test machine)."""
        return [n for n, a in self.accelerators.items() if a.kind == "gpu"]


def _lookup(where: str, what: str, name: str, table: MappingProxyType[str, Any]) -> Any:
    if not isinstance(name, str):
        raise SpecError(where, what, name, list(table))
    if name in table:
        return table[name]
    key = normalize_name(name)
    for known, value in table.items():
        if normalize_name(known) == key:
            return value
    raise SpecError(where, what, name, list(table))


# ---- loading ------------------------------------------------------------------------------------

def load_catalog(price_table: str | None = None, *, accelerators_path: str | Path | None = None,
                 precisions_path: str | Path | None = None) -> Catalog:
    """Load the shipped catalog (or the given files), priced from `price_table` (the file's default: 'modal')."""
    if accelerators_path is None and precisions_path is None:
        return _load_default(price_table)
    acc = Path(accelerators_path) if accelerators_path else data_path("accelerators.toml")
    prec = Path(precisions_path) if precisions_path else data_path("precisions.toml")
    return _load(acc, prec, price_table)


@lru_cache(maxsize=8)
def _load_default(price_table: str | None) -> Catalog:
    return _load(data_path("accelerators.toml"), data_path("precisions.toml"), price_table)


def _load(acc_path: Path, prec_path: Path, price_table: str | None) -> Catalog:
    precisions, kv_dtypes = _parse_precisions(prec_path)
    accelerators, tables, chosen, tsrc, tdate, ssrc, sdate = _parse_accelerators(acc_path, price_table)
    # consistency: a format native on an architecture needs that accelerator's TFLOP/s for it
    for acc in accelerators.values():
        for prec in precisions.values():
            if acc.arch in prec.native_arch and acc.peak_tflops(prec.compute) <= 0:
                raise SpecError(f"{acc_path} [accelerators.{acc.name}]", f"tflops_{prec.compute}",
                                acc.peak_tflops(prec.compute),
                                f"> 0, since precision '{prec.name}' is native on arch '{acc.arch}'")
            if acc.arch in prec.native_arch + prec.emulable_arch and acc.emulation_tflops <= 0:
                raise SpecError(f"{acc_path} [accelerators.{acc.name}]", "tflops_bf16", acc.tflops_bf16,
                                "> 0 (or tflops_fp32 > 0) so that emulated formats have a compute peak")
    return Catalog(accelerators=MappingProxyType(accelerators), precisions=MappingProxyType(precisions),
                   kv_dtypes=MappingProxyType(kv_dtypes), price_table=chosen, price_table_names=tables,
                   price_table_source=tsrc, price_table_date=tdate, spot_source=ssrc, spot_date=sdate)


def _parse_spot(where: str, raw: dict[str, Any], tables: tuple[str, ...], chosen: str, accs: tuple[str, ...]
                ) -> tuple[dict[str, tuple[float, float, bool]], str, str]:
    """The selected table's spot figures: accelerator -> (USD per GPU-hour, preemptions per replica-hour,
    estimate), with the spot table's source and date (none: empty)."""
    spot = get_table(where, raw, "spot", default={})
    for name in spot:
        if name not in tables:
            raise SpecError(where, f"spot.{name}", name, "a price table name: " + ", ".join(tables))
    if chosen not in spot:
        return {}, "", ""
    t = get_table(where, spot, chosen)
    w = f"{where} [spot.{chosen}]"
    check_keys(w, t, ("source", "date", "estimates", *accs))
    src, date = get_str(w, t, "source"), get_str(w, t, "date")
    estimates = get_str_list(w, t, "estimates", default=[], allowed=accs)
    out = {}
    for name in accs:
        if name not in t:
            continue
        e = get_table(w, t, name)
        check_keys(f"{w} {name}", e, ("usd", "preemptions_per_hour"))
        out[name] = (get_float(f"{w} {name}", e, "usd", lo=0.0, lo_open=True),
                     get_float(f"{w} {name}", e, "preemptions_per_hour", lo=0.0, hi=3600.0), name in estimates)
    return out, src, date


def _parse_accelerators(path: Path, price_table: str | None
                        ) -> tuple[dict[str, Accelerator], tuple[str, ...], str, str, str, str, str]:
    raw = read_toml(path)
    where = str(path)
    check_keys(where, raw, ("schema", "default_price_table", "defaults", "accelerators", "prices", "spot", "sandbox"))
    get_int(where, raw, "schema", lo=1, hi=1)
    defaults = get_table(where, raw, "defaults")
    check_keys(f"{where} [defaults]", defaults, _DEFAULTABLE)
    accs_raw = get_table(where, raw, "accelerators")
    prices = get_table(where, raw, "prices")
    if not prices:
        raise SpecError(where, "prices", prices, "at least one [prices.<table>]")
    tables = tuple(prices)
    chosen = price_table if price_table is not None else get_str(where, raw, "default_price_table", allowed=tables)
    if chosen not in prices:
        raise SpecError("catalog", "price_table", chosen, tables)
    ptable = get_table(where, prices, chosen)
    pwhere = f"{where} [prices.{chosen}]"
    tsrc = get_str(pwhere, ptable, "source")
    tdate = get_str(pwhere, ptable, "date")
    estimates = get_str_list(pwhere, ptable, "estimates", default=[], allowed=tuple(accs_raw))
    check_keys(pwhere, ptable, ("source", "date", "estimates", *accs_raw))
    spot, ssrc, sdate = _parse_spot(where, raw, tables, chosen, tuple(accs_raw))

    fields = ("kind", "arch", "memory_gb", "bandwidth_tb_s", "tflops_bf16", "tflops_fp8", "tflops_fp4",
              "tflops_fp32", "link", "link_gb_s", "cold_start_s", "estimate", "source", "date", *_DEFAULTABLE)
    out: dict[str, Accelerator] = {}
    for name, a in accs_raw.items():
        w = f"{where} [accelerators.{name}]"
        if not isinstance(a, dict):
            raise SpecError(where, f"accelerators.{name}", a, "a table")
        check_keys(w, a, fields)
        merged = {**defaults, **a}

        def num(key: str, lo: float = 0.0, hi: float | None = None, lo_open: bool = False,
                _m: dict[str, Any] = merged, _w: str = w) -> float:
            return get_float(_w, _m, key, lo=lo, hi=hi, lo_open=lo_open)

        if name not in ptable:
            raise SpecError(pwhere, name, None, f"a price for every accelerator (missing '{name}')")
        price = get_float(pwhere, ptable, name, lo=0.0, lo_open=True)
        out[name] = Accelerator(
            name=name, kind=get_str(w, a, "kind", allowed=KINDS), arch=get_str(w, a, "arch", allowed=ARCHS),
            memory_gb=num("memory_gb", lo_open=True), bandwidth_tb_s=num("bandwidth_tb_s", lo_open=True),
            tflops_bf16=num("tflops_bf16"), tflops_fp8=num("tflops_fp8"), tflops_fp4=num("tflops_fp4"),
            tflops_fp32=get_float(w, a, "tflops_fp32", default=0.0, lo=0.0),
            link=get_str(w, a, "link"), link_gb_s=num("link_gb_s"), link_latency_s=num("link_latency_s"),
            network_gb_s=num("network_gb_s", lo_open=True), cold_start_s=num("cold_start_s"),
            load_gb_s=num("load_gb_s", lo_open=True),
            max_tp=get_int(w, merged, "max_tp", lo=1, hi=max(TP_SIZES)),
            eff_bw=num("eff_bw", lo_open=True, hi=1.0), eff_flops=num("eff_flops", lo_open=True, hi=1.0),
            decode_overhead_s=num("decode_overhead_s"), prefill_overhead_s=num("prefill_overhead_s"),
            mem_util=num("mem_util", lo_open=True, hi=1.0), reserve_gb=num("reserve_gb"),
            trainer_mfu=num("trainer_mfu", lo_open=True, hi=1.0), trainer_overhead_s=num("trainer_overhead_s"),
            price_usd_per_gpu_hour=price, price_table=chosen, price_estimate=name in estimates,
            estimate=get_bool(w, a, "estimate", default=False), source=get_str(w, a, "source"),
            date=get_str(w, a, "date"),
            **({"spot_usd_per_gpu_hour": spot[name][0], "spot_preemptions_per_hour": spot[name][1],
                "spot_estimate": spot[name][2]} if name in spot else {}),
        )
        if out[name].max_tp > 1 and out[name].link_gb_s <= 0:
            raise SpecError(w, "link_gb_s", out[name].link_gb_s, "> 0 when max_tp > 1")
    return out, tables, chosen, tsrc, tdate, ssrc, sdate


@dataclass(frozen=True, kw_only=True)
class SandboxPrice:
    """What one sandbox (an episode's tool environment) costs per hour it is live, from the catalog's [sandbox]
    table: a provider's per-second rates per vCPU and per GiB of memory, for a stated size, with their source."""
    provider: str
    vcpus: float
    memory_gib: float
    usd_per_vcpu_s: float
    usd_per_gib_s: float
    source: str
    date: str

    @property
    def usd_per_hour(self) -> float:
        """Per sandbox-hour at the stated size: (vCPUs x vCPU rate + GiB x memory rate) x 3600."""
        return (self.vcpus * self.usd_per_vcpu_s + self.memory_gib * self.usd_per_gib_s) * 3600.0


def sandbox_price(accelerators_path: str | Path | None = None) -> SandboxPrice | None:
    """The catalog's sandbox price ([sandbox] of data/accelerators.toml, or the given file); None without one."""
    return _sandbox_price(str(accelerators_path or data_path("accelerators.toml")))


@lru_cache(maxsize=4)
def _sandbox_price(path: str) -> SandboxPrice | None:
    raw = read_toml(Path(path))
    if "sandbox" not in raw:
        return None
    w = f"{path} [sandbox]"
    t = get_table(path, raw, "sandbox")
    check_keys(w, t, ("provider", "vcpus", "memory_gib", "usd_per_vcpu_s", "usd_per_gib_s", "source", "date"))
    return SandboxPrice(provider=get_str(w, t, "provider"), vcpus=get_float(w, t, "vcpus", lo=0.0, lo_open=True),
                        memory_gib=get_float(w, t, "memory_gib", lo=0.0),
                        usd_per_vcpu_s=get_float(w, t, "usd_per_vcpu_s", lo=0.0),
                        usd_per_gib_s=get_float(w, t, "usd_per_gib_s", lo=0.0),
                        source=get_str(w, t, "source"), date=get_str(w, t, "date"))


def _sglang_flag(where: str, table: dict[str, Any], key: str, servers: tuple[str, ...]) -> str:
    """SGLang's flag value for a format: required when "sglang" serves it, refused otherwise."""
    if "sglang" not in servers:
        if key in table:
            raise SpecError(where, key, table[key], "no value unless servers names \"sglang\"")
        return ""
    return get_str(where, table, key)


def _parse_precisions(path: Path) -> tuple[dict[str, Precision], dict[str, KVDtype]]:
    raw = read_toml(path)
    where = str(path)
    check_keys(where, raw, ("schema", "precisions", "kv_dtypes"))
    get_int(where, raw, "schema", lo=1, hi=1)
    precs: dict[str, Precision] = {}
    for name, p in get_table(where, raw, "precisions").items():
        w = f"{where} [precisions.{name}]"
        if not isinstance(p, dict):
            raise SpecError(where, f"precisions.{name}", p, "a table")
        check_keys(w, p, ("description", "weight_bits", "scale_bits_per_weight", "keep_bytes_per_weight", "compute",
                          "native_arch", "emulable_arch", "emulation_slowdown", "requant_passes", "format",
                          "scales", "servers", "sglang_quantization", "kernel", "source", "date"))
        native = get_str_list(w, p, "native_arch", allowed=ARCHS)
        emulable = get_str_list(w, p, "emulable_arch", allowed=ARCHS)
        both = set(native) & set(emulable)
        if both:
            raise SpecError(w, "emulable_arch", sorted(both), "architectures not already in native_arch")
        precs[name] = Precision(
            name=name, description=get_str(w, p, "description"),
            weight_bits=get_int(w, p, "weight_bits", lo=1, hi=32),
            scale_bits_per_weight=get_float(w, p, "scale_bits_per_weight", lo=0.0, hi=32.0),
            keep_bytes_per_weight=get_float(w, p, "keep_bytes_per_weight", lo=0.0, hi=8.0, lo_open=True),
            compute=get_str(w, p, "compute", allowed=COMPUTES), native_arch=native, emulable_arch=emulable,
            emulation_slowdown=get_float(w, p, "emulation_slowdown", lo=1.0),
            requant_passes=get_float(w, p, "requant_passes", lo=0.0),
            format=get_str(w, p, "format", default=""), scales=get_str_list(w, p, "scales", default=[]),
            servers=(servers := get_str_list(w, p, "servers", default=[], allowed=SERVERS)),
            sglang_quantization=_sglang_flag(w, p, "sglang_quantization", servers),
            kernel=get_bool(w, p, "kernel", default=False),
            source=get_str(w, p, "source"), date=get_str(w, p, "date"),
        )
    kvs: dict[str, KVDtype] = {}
    for name, k in get_table(where, raw, "kv_dtypes").items():
        w = f"{where} [kv_dtypes.{name}]"
        if not isinstance(k, dict):
            raise SpecError(where, f"kv_dtypes.{name}", k, "a table")
        check_keys(w, k, ("description", "bytes_per_element", "servers", "sglang_kv_cache_dtype", "source", "date"))
        servers = get_str_list(w, k, "servers", default=[], allowed=SERVERS)
        kvs[name] = KVDtype(name=name, description=get_str(w, k, "description"),
                            bytes_per_element=get_float(w, k, "bytes_per_element", lo=0.0, hi=8.0, lo_open=True),
                            servers=servers, sglang_kv_cache_dtype=_sglang_flag(w, k, "sglang_kv_cache_dtype", servers),
                            source=get_str(w, k, "source"), date=get_str(w, k, "date"))
    if not precs or not kvs:
        raise SpecError(where, "precisions/kv_dtypes", None, "at least one of each")
    return precs, kvs
