"""Registered methods: plain fine-tuning, the JASCL preset and its ablations and comparisons.

Every JASCL-family method reads one options block, ``method_args.jascl``
(:class:`JasclOptions`): GAS (``gas``), prototype replay (``replay``), the mean
teacher with PAS (``pas``) and the preset's switches (``components``), so an
ablation and the full method always run with the same settings. The spellings of
earlier versions (``--set gas.eps=1e-9``, a protocol's ``training.pas``) are read
as ``method_args.jascl.<section>`` (:func:`jascl.engine.config.resolve_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jascl.engine.config import RunConfig
from jascl.engine.plugin import Method, Plugin
from jascl.methods.gas_plugin import GASPlugin
from jascl.methods.mean_teacher import MeanTeacherPlugin
from jascl.methods.options import option, read_options
from jascl.methods.registry import METHODS
from jascl.methods.replay import PrototypeReplayPlugin
from jascl.methods.stochastic_base import StochasticBasePlugin

PAPER = "JASCL (ICML 2026)"


@dataclass
class GASOptions:
    """GAS (paper eq. 1; defaults from the paper's appendix on GAS robustness).

    Attributes:
        layer: the perturbed layer: "classifier" (paper), "encoder", "decoder" or a module path.
        eps: stabiliser of the inverse gradient.
        sigma2: variance of the Gaussian noise.
        in_base: also perturb in session 0 (the authors apply GAS in incremental sessions only).
        variant: "paper" (eq. 1 as printed, computed in float64) or "authors" (their float32 evaluation,
            which makes a session's first step noise-free, and the old rows' gradient buffer carried over).
    """

    layer: str = "classifier"
    eps: float = option(1e-8, gt=0)
    sigma2: float = option(1.0, ge=0)
    in_base: bool = False
    variant: str = option("paper", choices=("paper", "authors"))


@dataclass
class ReplayOptions:
    """Prototype replay (L_proto): weight 0.1 and a sum over prototypes, as in the authors' medical code.

    Attributes:
        weight: loss weight of L_proto.
        reduction: "sum" (authors) or "mean" over the replayed prototypes.
        background: "per-class" (default, the authors' store: each class's prototype with the
            prototype of its complement, target background) or "session" (one background
            prototype per session; see :mod:`jascl.methods.replay`).
        values: "eq2" (default: the prototype store's eq. 2 prototypes) or "authors" (per sample the mean
            of L2-normalised pixel features, averaged over samples without renormalising; the complement
            includes ignore pixels: their ``get_prototype``).
        base_samples: with values=authors, the session-0 prototypes average this many randomly chosen
            (seeded) samples of each class (authors: 10; 0 = every labelled sample).
        noise_draws: "shared" (one classifier call, hence one GAS noise draw, for all replayed prototypes
            of a step) or "per-prototype" (one call and draw per prototype, as the authors' loop does).
    """

    weight: float = option(0.1, ge=0)
    reduction: str = option("sum", choices=("sum", "mean"))
    background: str = option("per-class", choices=("per-class", "session"))
    values: str = option("eq2", choices=("eq2", "authors"))
    base_samples: int = option(0, ge=0)
    noise_draws: str = option("shared", choices=("shared", "per-prototype"))


@dataclass
class PASOptions:
    """The mean teacher and PAS on unlabelled pools.

    Defaults: tau_conf = tau_sim = 0.7 (paper, "Hyperparameters"); lambda_cons 0.05, EMA
    decay 0.99, an unlabelled phase every 25 epochs from epoch 25 (the authors' medical
    semi-supervised code, per AUTHORS-CODE-NOTES). The pool baselines (UaD-CE, CSL,
    RETRIEVE) use the same phase schedule, so semi-supervised methods compare on equal terms.

    Attributes:
        tau_conf: confidence threshold of eq. 4.
        tau_sim: prototype-similarity threshold of eq. 4.
        weight: lambda_cons, weight of the consistency loss (eq. 5).
        ema_decay: the teacher's EMA decay.
        start_epoch: first epoch of an unlabelled phase.
        every: epochs between unlabelled phases.
        batch_size: unlabelled batch size (null: the labelled one).
        normalize_pixels: false (default, eq. 2): a sample's prototype is the plain mean of its class
            features; true: the mean of L2-normalised pixel features (the authors' get_prototype).
        anchors: "mean" (default, eqs. 2-3: one class prototype P_c, the mean of the unit-normalised
            per-sample prototypes, and the cosine to it) or "per-sample" (every labelled sample's
            prototype, the summands of eq. 2; the best match counts: the ``jascl-anchors`` variant).
        max_anchors: per class at most this many per-sample anchors, a spread-out subset (0 = all).
        ema: "step" (default: the teacher follows the student by one EMA step after every optimiser step)
            or "phase" (one EMA step over the parameters at the end of each unlabelled phase: the authors'
            ``update_teacher``).
    """

    tau_conf: float = option(0.7, ge=0, le=1)
    tau_sim: float = option(0.7, ge=0, le=1)
    weight: float = option(0.05, ge=0)
    ema_decay: float = option(0.99, ge=0, lt=1)
    start_epoch: int = option(25, ge=0)
    every: int = option(25, ge=1)
    batch_size: int | None = option(None, ge=1)
    normalize_pixels: bool = False
    anchors: str = option("mean", choices=("per-sample", "mean"))
    max_anchors: int = option(16, ge=0)
    ema: str = option("step", choices=("step", "phase"))


@dataclass
class Components:
    """Switches of the ``jascl`` preset, for ablations (``--ablate gas,pas,proto``).

    Attributes:
        gas: gradient-adaptive stabilization.
        replay: prototype replay.
        pas: the mean teacher with PAS on unlabelled pools.
    """

    gas: bool = True
    replay: bool = True
    pas: bool = True


@dataclass
class JasclOptions:
    """``method_args.jascl``: the options every JASCL-family method reads.

    Attributes:
        base: "stochastic" (default): session 0 trains the classifier with learned Gaussian weight noise,
            as the authors' base code does (:mod:`jascl.methods.stochastic_base`; the JASCL family shares
            that base); "shared": start from the vanilla base every baseline shares (fair component
            comparisons with the baselines).
    """

    base: str = option("stochastic", choices=("stochastic", "shared"))
    gas: GASOptions = field(default_factory=GASOptions)
    replay: ReplayOptions = field(default_factory=ReplayOptions)
    pas: PASOptions = field(default_factory=PASOptions)
    components: Components = field(default_factory=Components)


def jascl_options(config: RunConfig) -> JasclOptions:
    """The run's ``method_args.jascl`` (for methods outside the family that share its unlabelled schedule)."""
    return read_options(JasclOptions, config, "jascl")


def _base(o: JasclOptions) -> list[Plugin]:
    return [StochasticBasePlugin()] if o.base == "stochastic" else []


def _gas(o: JasclOptions) -> GASPlugin:
    return GASPlugin(
        layer=o.gas.layer, eps=o.gas.eps, sigma2=o.gas.sigma2, in_base=o.gas.in_base, variant=o.gas.variant
    )


def _replay(o: JasclOptions) -> PrototypeReplayPlugin:
    r = o.replay
    return PrototypeReplayPlugin(
        weight=r.weight,
        reduction=r.reduction,
        background=r.background,
        values=r.values,
        base_samples=r.base_samples,
        noise_draws=r.noise_draws,
    )


def teacher_options(o: JasclOptions) -> dict:
    """The keyword arguments every JASCL mean teacher takes from ``method_args.jascl.pas`` (pixels and boxes)."""
    p = o.pas
    return {
        "tau_conf": p.tau_conf,
        "tau_sim": p.tau_sim,
        "weight": p.weight,
        "ema_decay": p.ema_decay,
        "start_epoch": p.start_epoch,
        "every": p.every,
        "batch_size": p.batch_size,
        "normalize_pixels": p.normalize_pixels,
        "max_anchors": p.max_anchors,
        "ema": p.ema,
    }


def _mean_teacher(o: JasclOptions, filter: str) -> MeanTeacherPlugin:
    return MeanTeacherPlugin(filter=filter, anchors=o.pas.anchors, **teacher_options(o))


def _family(name: str, doc: str):
    return METHODS.register(name, doc=doc, options=JasclOptions, options_key="jascl", paper=PAPER, fidelity="faithful")


@METHODS.register(
    "vanilla",
    doc="plain fine-tuning of the same backbone (the paper's 'Vanilla' row)",
    paper=PAPER,
    fidelity="faithful",
)
def vanilla(config: RunConfig) -> Method:
    """Fine-tuning with the loop's defaults only: DiceCE, prototype-imprinted new rows, no protection of old classes."""
    return Method("vanilla", [], "plain fine-tuning")


@_family("jascl", "GAS + prototype replay + PAS mean teacher on unlabelled pools (--ablate gas,pas,proto)")
def jascl(o: JasclOptions, config: RunConfig) -> Method:
    """JASCL: GAS on the classifier (eq. 1), prototype replay (L_proto) and the PAS mean teacher (eqs. 2-5).

    ``components`` switches each part off for ablations; ``jascl methods jascl`` lists every option.
    """
    return Method("jascl", _jascl_plugins(o), "gradient-adaptive stabilization + prototype replay + PAS")


def _jascl_plugins(o: JasclOptions) -> list[Plugin]:
    """The session-0 plugin (unless ``base=shared``) and the components ``o.components`` switches on."""
    plugins: list[Plugin] = _base(o)
    if o.components.gas:
        plugins.append(_gas(o))
    if o.components.replay:
        plugins.append(_replay(o))
    if o.components.pas:
        plugins.append(_mean_teacher(o, "pas"))
    return plugins


@_family("jascl-no-unlabelled", "comparison: JASCL ignoring unlabelled pools (GAS + prototype replay)")
def jascl_no_unlabelled(o: JasclOptions, config: RunConfig) -> Method:
    """GAS + prototype replay, labelled data only."""
    return Method("jascl-no-unlabelled", [*_base(o), _gas(o), _replay(o)], "GAS + prototype replay, labelled data only")


@_family("jascl-conf", "comparison: JASCL with a confidence-only mean teacher (no prototype check)")
def jascl_conf(o: JasclOptions, config: RunConfig) -> Method:
    """GAS + prototype replay + a mean teacher whose pseudo-labels pass eq. 4's confidence test alone."""
    return Method(
        "jascl-conf",
        [*_base(o), _gas(o), _replay(o), _mean_teacher(o, "confidence")],
        "GAS + prototype replay + mean teacher with confidence-only filtering",
    )


@_family("mean-teacher-conf", "baseline: fine-tuning + mean teacher with confidence-only pseudo-labels")
def mean_teacher_conf(o: JasclOptions, config: RunConfig) -> Method:
    """Plain fine-tuning plus the mean teacher with confidence-only filtering (the semi-supervised baseline)."""
    return Method(
        "mean-teacher-conf",
        [_mean_teacher(o, "confidence")],
        "plain fine-tuning + mean teacher with confidence-only filtering",
    )


@_family("jascl-no-gas", "ablation: JASCL without GAS (prototype replay + PAS)")
def jascl_no_gas(o: JasclOptions, config: RunConfig) -> Method:
    """The ablation without GAS."""
    return Method("jascl-no-gas", [*_base(o), _replay(o), _mean_teacher(o, "pas")], "prototype replay + PAS")


@_family("jascl-no-pas", "ablation: JASCL without PAS (GAS + prototype replay; unlabelled pools unused)")
def jascl_no_pas(o: JasclOptions, config: RunConfig) -> Method:
    """The paper's "JASCL w/o PAS" rows (the semi-supervised driving ablation, the detection table): the
    ``jascl`` preset with ``--ablate pas``, i.e. GAS + prototype replay with no mean teacher.

    The paper does not define the ablation beyond its name. PAS is the supervision the unlabelled pool
    gives through the prototype-anchored teacher, so removing it removes the pool's supervision: that is
    what ``--ablate pas`` has always switched off, and this preset is the same plugins under the paper's
    row name (it equals ``jascl-no-unlabelled``). The other reading -- the teacher kept with
    confidence-only pseudo-labels, the setting of the paper's theorem on pseudo-label error without PAS --
    is ``jascl-conf``.
    """
    return Method("jascl-no-pas", [*_base(o), _gas(o), _replay(o)], "GAS + prototype replay (w/o PAS)")


@_family("jascl-no-replay", "ablation: JASCL without prototype replay (GAS + PAS)")
def jascl_no_replay(o: JasclOptions, config: RunConfig) -> Method:
    """The ablation without prototype replay."""
    return Method("jascl-no-replay", [*_base(o), _gas(o), _mean_teacher(o, "pas")], "GAS + PAS")


@_family(
    "jascl-anchors",
    "variant: JASCL whose PAS compares each pixel with every labelled sample's prototype (normalised pixels)",
)
def jascl_anchors(o: JasclOptions, config: RunConfig) -> Method:
    """JASCL with the per-sample-anchor PAS (jascl's default before eqs. 2-3 were followed literally).

    PAS compares an unlabelled pixel with the prototype of every labelled sample of its predicted class
    (eq. 2's summands, built from L2-normalised pixel features as the authors' get_prototype does) and
    keeps the best match, instead of eq. 3's cosine to the one class prototype. Set by this preset
    unless ``method_args.jascl.pas`` says otherwise for ``anchors`` / ``normalize_pixels``.
    """
    import dataclasses

    pas = o.pas
    if pas.anchors == "mean" and not pas.normalize_pixels:  # the literal defaults: switch to the variant
        pas = dataclasses.replace(pas, anchors="per-sample", normalize_pixels=True)
    return Method("jascl-anchors", _jascl_plugins(dataclasses.replace(o, pas=pas)), "JASCL with per-sample PAS anchors")


METHODS.register_composition(
    "jascl+gaps",
    doc="JASCL as a plug-in on GAPS (the paper's semi-supervised driving headline): jascl's plugins, then gaps'",
    paper=f"{PAPER}; Qiu et al., ICCV 2023 (GAPS)",
)
