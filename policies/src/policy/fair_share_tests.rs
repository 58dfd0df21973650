//! Fair-share tests: the counters and the lift on hand-made events, then admission orders
//! through the real scheduler (the review's reproductions, in small).

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::policy::testutil::seq;
use crate::sequence::Sequence;
use crate::types::{Request, SamplingLimits, SchedulerConfig, SloTargets, StepOutput};
use crate::Scheduler;

/// A waiting request of `tenant` ("a" is tenant 0, "b" 1, ...) with a 10-token prompt.
fn of(tenant: &str, id: u64) -> Sequence {
    let mut s = seq(id, id, 10);
    s.req.tenant = tenant.into();
    s.tenant_id = u32::from(tenant.as_bytes()[0] - b'a');
    s
}

fn arrive(p: &mut FairShare, s: &Sequence) {
    p.observe(PolicyEvent::Arrived(SeqView::new(s)));
}

/// Serves `s` (admitting it first if it waits) with `prompt` prompt and `out` output tokens.
fn serve(p: &mut FairShare, s: &mut Sequence, prompt: usize, out: usize) {
    s.state = RequestState::Running;
    p.observe(PolicyEvent::Served {
        seq: SeqView::new(s),
        prompt_tokens: prompt,
        output_tokens: out,
    });
}

/// Admits `s` as the planner does, before any of it is served.
fn admit(p: &mut FairShare, s: &mut Sequence) {
    s.state = RequestState::Running;
    p.observe(PolicyEvent::Admitted(SeqView::new(s)));
}

/// Preempts `s` as the planner does.
fn preempt(p: &mut FairShare, s: &mut Sequence) {
    s.state = RequestState::Preempted;
    p.observe(PolicyEvent::Preempted(SeqView::new(s)));
}

fn depart(p: &mut FairShare, s: &mut Sequence) {
    s.state = RequestState::Finished(crate::types::FinishReason::Length);
    p.observe(PolicyEvent::Departed(SeqView::new(s)));
}

fn key_of(p: &FairShare, s: &Sequence) -> i64 {
    p.rank(SeqView::new(s), Timestamp(0)).key
}

#[test]
fn counters_charge_input_and_output_with_tenant_weight() {
    let mut w = BTreeMap::new();
    w.insert("b".to_string(), 2.0);
    let mut p = FairShare::new(1.0, 2.0, w);
    let (mut a, mut b) = (of("a", 1), of("b", 2));
    let (a2, b2) = (of("a", 3), of("b", 4));
    for s in [&a, &a2, &b, &b2] {
        arrive(&mut p, s);
    }
    serve(&mut p, &mut a, 100, 1); // 100 + 2 = 102
    serve(&mut p, &mut b, 100, 1); // 102 / 2 = 51
    assert_eq!(p.counter(0), 102.0);
    assert_eq!(p.counter(1), 51.0);
    // Both stayed backlogged; b has received less weighted service, so b's next request
    // comes first.
    assert!(p.rank(SeqView::new(&b2), Timestamp(0)) < p.rank(SeqView::new(&a2), Timestamp(0)));
}

#[test]
fn tier_weight_multiplies_tenant_weight() {
    let mut w = BTreeMap::new();
    w.insert("a".to_string(), 2.0);
    let tiers = BTreeMap::from([("premium".to_string(), 4.0)]);
    let mut p = FairShare::new(1.0, 2.0, w).with_tier_weights(tiers);
    let mut a = of("a", 1);
    a.req.tier = "premium".into();
    let mut b = of("b", 2);
    b.req.tier = "unknown".into(); // not configured: weight 1
    arrive(&mut p, &a);
    arrive(&mut p, &b);
    serve(&mut p, &mut a, 80, 0); // 80 / (2 * 4)
    serve(&mut p, &mut b, 80, 0);
    assert_eq!(p.counter(0), 10.0);
    assert_eq!(p.counter(1), 80.0);
}

#[test]
fn arriving_tenant_is_lifted_to_the_smallest_backlogged_counter() {
    let mut p = FairShare::new(1.0, 2.0, BTreeMap::new());
    let (mut a, mut b) = (of("a", 1), of("b", 2));
    let (a2, b2) = (of("a", 3), of("b", 4));
    for s in [&a, &a2, &b, &b2] {
        arrive(&mut p, s);
    }
    serve(&mut p, &mut a, 500, 0);
    serve(&mut p, &mut b, 300, 0);
    // a and b still wait (at 500 and 300); c arrives: lifted to 300.
    let c = of("c", 5);
    arrive(&mut p, &c);
    assert_eq!(p.counter(2), 300.0);
    // A tenant that is already backlogged is not lifted.
    arrive(&mut p, &of("b", 6));
    assert_eq!(p.counter(1), 300.0);
}

/// Review finding 1a (/tmp/review-sched/vtc): after an idle period the first tenant to
/// arrive kept its stale counter and a tenant arriving a moment later was "lifted" to it.
#[test]
fn idle_time_is_not_banked_when_no_tenant_waits() {
    let mut p = FairShare::new(1.0, 2.0, BTreeMap::new());
    // b is seen once, cheaply; a then works alone and everything ends.
    let mut b = of("b", 1);
    arrive(&mut p, &b);
    serve(&mut p, &mut b, 10, 0);
    depart(&mut p, &mut b);
    let mut a = of("a", 2);
    arrive(&mut p, &a); // lifted to b's 10
    serve(&mut p, &mut a, 3000, 0);
    serve(&mut p, &mut a, 0, 500);
    depart(&mut p, &mut a);
    assert_eq!((p.counter(0), p.counter(1)), (4010.0, 10.0));
    // After the idle period b arrives first: no tenant waits, so b is lifted to the system
    // virtual time (a's counter, a being the last tenant to leave the backlog).
    let b2 = of("b", 3);
    arrive(&mut p, &b2);
    assert_eq!(p.counter(1), 4010.0);
    // a arrives a moment later and is lifted to b's counter: they now tie.
    let a2 = of("a", 4);
    arrive(&mut p, &a2);
    assert_eq!(key_of(&p, &a2), key_of(&p, &b2));
}

/// Review finding 1b (/tmp/review-sched/vtc3): a tenant with running but no waiting
/// requests was never lifted, so it banked the service it did not ask for.
#[test]
fn tenant_with_only_running_requests_is_lifted() {
    let mut p = FairShare::new(1.0, 2.0, BTreeMap::new());
    let (mut b, mut a) = (of("b", 1), of("a", 2));
    arrive(&mut p, &b);
    arrive(&mut p, &a);
    serve(&mut p, &mut b, 10, 0); // b's long request runs
    serve(&mut p, &mut a, 1000, 0);
    let a2 = of("a", 3);
    arrive(&mut p, &a2); // a is backlogged at 1000
    serve(&mut p, &mut b, 0, 100); // b: 10 + 200
    let b2 = of("b", 4);
    arrive(&mut p, &b2);
    assert_eq!(p.counter(1), 1000.0);
}

/// An admission takes the request out of its tenant's backlog as it is planned, before any of
/// it is served: the tenant's next request is lifted as VTC lifts a tenant with nothing
/// waiting (before, the admitted request still counted as waiting until its first chunk was
/// served, and the next one ranked at the tenant's stale counter).
#[test]
fn an_admission_ends_the_backlog_when_it_is_planned() {
    let mut p = FairShare::new(1.0, 2.0, BTreeMap::new());
    let (mut a, mut b) = (of("a", 1), of("b", 2));
    let b2 = of("b", 3);
    for s in [&a, &b, &b2] {
        arrive(&mut p, s);
    }
    serve(&mut p, &mut b, 500, 0);
    // b is backlogged at 500 (+10 for b2 ahead of nothing: b2 is its queue); a's only
    // request is admitted, not yet served.
    admit(&mut p, &mut a);
    let a2 = of("a", 4);
    arrive(&mut p, &a2);
    // Lifted to b's projected counter, less what a's admitted request will be charged.
    assert_eq!(p.tenant(0).map(Tenant::projected), Some(500.0));
    assert_eq!(p.counter(0), 490.0);
    // Serving the admitted request charges its prompt once.
    serve(&mut p, &mut a, 10, 0);
    assert_eq!(p.counter(0), 500.0);
}

/// A tenant whose only waiting requests were preempted is still backlogged: it is not lifted
/// when it sends more (it waits; its counter is not stale), and it leaves the backlog, moving
/// the system virtual time, when the preempted request runs again.
#[test]
fn a_tenant_with_preempted_requests_waiting_is_backlogged() {
    let mut p = FairShare::new(1.0, 2.0, BTreeMap::new());
    let (mut a, mut b) = (of("a", 1), of("b", 2));
    let b2 = of("b", 3);
    for s in [&a, &b, &b2] {
        arrive(&mut p, s);
    }
    admit(&mut p, &mut a);
    serve(&mut p, &mut a, 10, 0);
    serve(&mut p, &mut b, 500, 0);
    preempt(&mut p, &mut a);
    let a2 = of("a", 4);
    arrive(&mut p, &a2);
    assert_eq!(p.counter(0), 10.0);
    // a's preempted request runs again; a2 still waits, so a stays backlogged.
    admit(&mut p, &mut a);
    assert!(p.tenant(0).is_some_and(Tenant::backlogged));
    let vtime = p.vtime;
    // Without a preempted request left, a's last waiting request leaves the backlog with its
    // admission, and the virtual time moves to a's counter.
    let mut a2 = a2;
    admit(&mut p, &mut a2);
    assert!(!p.tenant(0).is_some_and(Tenant::backlogged));
    assert!(p.vtime >= vtime && p.vtime >= 20.0);
    // A preempted request that departs leaves the backlog too.
    preempt(&mut p, &mut a2);
    assert!(p.tenant(0).is_some_and(Tenant::backlogged));
    depart(&mut p, &mut a2);
    assert!(!p.tenant(0).is_some_and(Tenant::backlogged));
}

#[test]
fn system_virtual_time_never_moves_back() {
    let mut p = FairShare::new(1.0, 2.0, BTreeMap::new());
    let (mut a, mut b) = (of("a", 1), of("b", 2));
    a.prompt_len = 900;
    arrive(&mut p, &a);
    arrive(&mut p, &b);
    serve(&mut p, &mut a, 900, 0); // a leaves the backlog at 900
    serve(&mut p, &mut b, 10, 0); // b leaves it last, at 10
    depart(&mut p, &mut a);
    depart(&mut p, &mut b);
    // No one waits: c is lifted to the virtual time, which a took to 900.
    let c = of("c", 3);
    arrive(&mut p, &c);
    assert_eq!(p.counter(2), 900.0);
}

/// Review finding 2 (/tmp/review-sched/vtc2): seats freed in one step went to one tenant in
/// a block; each waiting request now ranks at the counter its tenant would have once the
/// requests ahead of it are charged, so one step's admissions alternate.
#[test]
fn waiting_requests_rank_as_if_charged_at_admission() {
    let mut p = FairShare::new(1.0, 2.0, BTreeMap::new());
    let mut order: Vec<(Rank, u64, &str)> = Vec::new();
    let seqs: Vec<Sequence> = (0..6)
        .map(|i| of(if i < 3 { "a" } else { "b" }, i))
        .collect();
    for s in &seqs {
        arrive(&mut p, s);
    }
    for s in &seqs {
        order.push((key_rank(&p, s), s.id.0, s.req.tenant.as_str()));
    }
    order.sort();
    let tenants: Vec<&str> = order.iter().map(|o| o.2).collect();
    assert_eq!(tenants, ["a", "b", "a", "b", "a", "b"]);
}

fn key_rank(p: &FairShare, s: &Sequence) -> Rank {
    p.rank(SeqView::new(s), Timestamp(0))
}

#[test]
fn running_requests_keep_arrival_order() {
    let p = FairShare::new(1.0, 2.0, BTreeMap::new());
    let mut r = of("a", 1);
    r.state = RequestState::Running;
    assert_eq!(p.rank(SeqView::new(&r), Timestamp(0)), Rank::default());
}

#[test]
fn weights_out_of_range_are_refused_naming_the_tenant_or_tier() {
    let v: serde_yaml::Value = serde_yaml::from_str("{tenant_weights: {acme: 1e-300}}").unwrap();
    let e = FairShare::create(&v, &[]).err().unwrap().to_string();
    assert!(e.contains("tenant_weights") && e.contains("`acme`"), "{e}");
    let tier = TierSpec {
        name: "gold".into(),
        ttft_ms: None,
        tpot_ms: None,
        weight: 1e-9,
        preemptible: false,
        max_queue_ms: None,
        max_kv_fraction: None,
    };
    let e = FairShare::create(&serde_yaml::Value::Null, &[tier])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("`gold`"), "{e}");
}

// ---- Through the scheduler ----

/// Requests (tenant, tier, prompt, max_tokens) are added by `add`; `run` steps until idle
/// and returns the tenants in admission order.
struct Sim {
    s: Scheduler,
    now: u64,
    next_id: u64,
    tenant_of: BTreeMap<u64, String>,
    admitted: std::collections::BTreeSet<u64>,
}

impl Sim {
    fn new(max_num_seqs: usize, tiers: Vec<TierSpec>, params: &str) -> Self {
        let c = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: 8192,
            block_size: 16,
            num_gpu_blocks: 4096,
            enable_prefix_caching: false,
            max_model_len: 2048,
            tiers: tiers.clone(),
            ..SchedulerConfig::default()
        };
        let params: serde_yaml::Value = serde_yaml::from_str(params).unwrap();
        let p = FairShare::create(&params, &tiers).unwrap();
        Self {
            s: Scheduler::new(c, p, [1, 2]).unwrap(),
            now: 0,
            next_id: 0,
            tenant_of: BTreeMap::new(),
            admitted: Default::default(),
        }
    }

    fn add(&mut self, n: usize, tenant: &str, tier: &str, prompt: usize, max_tokens: u32) {
        for _ in 0..n {
            let id = self.next_id;
            self.next_id += 1;
            let r = Request {
                id: RequestId(id),
                tenant: tenant.into(),
                tier: tier.into(),
                priority: 0,
                lora_adapter: None,
                arrival: Timestamp(self.now),
                slo: SloTargets::default(),
                prompt: Arc::from(vec![3u32; prompt]),
                limits: SamplingLimits {
                    max_tokens,
                    ..SamplingLimits::default()
                },
                cache_salt: None,
            };
            self.s.add_request(r).unwrap();
            self.tenant_of.insert(id, tenant.into());
        }
    }

    /// Steps `steps` times (0: until idle); returns the tenants admitted, in order.
    fn run(&mut self, steps: usize) -> String {
        let mut order = String::new();
        let mut n = 0;
        while self.s.has_unfinished() && (steps == 0 || n < steps) {
            n += 1;
            self.now += 1000;
            let plan = self.s.schedule(Timestamp(self.now));
            for q in &plan.seqs {
                if self.admitted.insert(q.id.0) {
                    order.push_str(&self.tenant_of[&q.id.0]);
                }
            }
            let outs: Vec<StepOutput> = plan
                .seqs
                .iter()
                .filter(|q| q.samples)
                .map(|q| StepOutput::new(q.id, 7))
                .collect();
            self.s.apply_outputs(&plan, &outs, Timestamp(self.now));
            self.s.check_invariants().unwrap();
        }
        order
    }
}

fn tier(name: &str, weight: f64) -> TierSpec {
    TierSpec {
        name: name.into(),
        ttft_ms: None,
        tpot_ms: None,
        weight,
        preemptible: false,
        max_queue_ms: None,
        max_kv_fraction: None,
    }
}

/// The reproduction of finding 1a: a works alone, the system idles, then b, then a (and
/// the rest of b) arrive. Before the fix b's stale counter gave it all 20 seats in a row.
#[test]
fn after_an_idle_period_tenants_alternate() {
    let mut sim = Sim::new(1, vec![], "{}");
    sim.add(20, "A", "", 100, 50);
    assert_eq!(sim.run(0), "A".repeat(20));
    sim.now += 100_000_000; // 100 s idle
    sim.add(1, "B", "", 100, 50);
    sim.now += 1;
    sim.add(20, "A", "", 100, 50);
    sim.add(19, "B", "", 100, 50);
    let order = sim.run(0);
    // Equal requests: the tenants alternate (ties go to the lower id, so runs of two).
    assert!(order.starts_with("BA"), "{order}");
    assert!(
        !order[..38].contains("AAA") && !order[..38].contains("BBB"),
        "{order}"
    );
}

/// The reproduction of finding 1b: b's one long request runs beside a's backlog; when b
/// sends more, b is lifted to a's counter instead of overtaking a's whole backlog.
#[test]
fn tenant_that_only_ran_does_not_overtake_a_backlog() {
    let mut sim = Sim::new(2, vec![], "{}");
    sim.add(1, "B", "", 10, 1500);
    sim.run(1);
    sim.add(300, "A", "", 100, 50);
    sim.run(1000);
    sim.add(30, "B", "", 100, 50);
    // Before the fix B's counter (10 + 2 per step of its long request) was about half of
    // A's, so B's next 8 or so requests went first.
    let order = sim.run(600);
    let a = order[..8].bytes().filter(|&c| c == b'A').count();
    assert!(order.starts_with('A') && a >= 4, "{order}");
}

/// The reproduction of finding 2: 16 seats free at once are shared, not given to A.
#[test]
fn seats_freed_in_one_step_are_shared() {
    let mut sim = Sim::new(16, vec![], "{}");
    sim.add(32, "A", "", 200, 200);
    sim.add(32, "B", "", 200, 200);
    let first = sim.run(1);
    assert_eq!(first, "AB".repeat(8));
    let rest = sim.run(0);
    let blocks = rest.as_bytes().chunks(16);
    for b in blocks {
        let a = b.iter().filter(|&&c| c == b'A').count();
        assert!((7..=9).contains(&a), "{rest}");
    }
}

/// Finding 3: a premium tier of weight 4 gets about four times the service of a standard
/// tier of weight 1 while both are backlogged (equal requests, so admissions count it).
#[test]
fn tier_of_weight_4_gets_four_times_the_service() {
    let tiers = vec![tier("premium", 4.0), tier("standard", 1.0)];
    let mut sim = Sim::new(4, tiers, "{}");
    sim.add(64, "A", "premium", 200, 100);
    sim.add(64, "B", "standard", 200, 100);
    let order = sim.run(0);
    // While both are backlogged (the first 60 admissions), A gets 4 in 5.
    let a = order[..60].bytes().filter(|&c| c == b'A').count();
    assert!((46..=50).contains(&a), "{a}: {order}");
    // The same through the tenant weight.
    let mut sim = Sim::new(4, vec![], "{tenant_weights: {A: 4}}");
    sim.add(64, "A", "", 200, 100);
    sim.add(64, "B", "", 200, 100);
    let order = sim.run(0);
    let a = order[..60].bytes().filter(|&c| c == b'A').count();
    assert!((46..=50).contains(&a), "{a}: {order}");
}

// ---- The incremental bookkeeping against a recomputation ----

#[derive(Clone, Debug)]
enum Op {
    /// A request of tenant `.0` (0..3) with `.1` prompt tokens arrives.
    Arrive(u8, usize),
    /// The `.0`-th live request (mod live) is served: `.1` prompt and `.2` output tokens.
    Serve(usize, usize, usize),
    /// The `.0`-th live request (mod live) ends.
    Depart(usize),
    /// The `.0`-th live request (mod live), if it waits, is admitted (planned).
    Admit(usize),
    /// The `.0`-th live request (mod live), if it runs, is preempted.
    Preempt(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..3, 1usize..40).prop_map(|(t, p)| Op::Arrive(t, p)),
        (0usize..16, 0usize..40, 0usize..3).prop_map(|(i, p, o)| Op::Serve(i, p, o)),
        (0usize..16).prop_map(Op::Depart),
        (0usize..16).prop_map(Op::Admit),
        (0usize..16).prop_map(Op::Preempt),
    ]
}

proptest! {
    /// After any sequence of arrivals, admissions, services, preemptions and departures:
    /// every never-admitted waiting request ranks at its tenant's counter plus the uncharged
    /// prompts of the tenant's admitted requests and of its waiting requests ahead of it, a
    /// preempted one at the counter plus the admitted requests' (recomputed from scratch); an
    /// arrival for a tenant with no waiting request (never admitted or preempted) lifts it at
    /// least to the smallest such counter among backlogged tenants, or to the system virtual
    /// time, which never decreases.
    #[test]
    fn ranks_match_a_recomputation_and_the_lift_holds(ops in prop::collection::vec(op(), 1..80)) {
        let tiers = BTreeMap::from([("t".to_string(), 2.0)]);
        let mut p = FairShare::new(1.0, 2.0, BTreeMap::from([("b".to_string(), 3.0)]))
            .with_tier_weights(tiers);
        // Live requests with their uncharged prompt tokens, in arrival order.
        let mut live: Vec<(Sequence, usize)> = Vec::new();
        let mut next = 0u64;
        let mut vtime = 0.0f64;
        for op in ops {
            match op {
                Op::Arrive(t, prompt) => {
                    let name = ["a", "b", "c"][t as usize];
                    let mut s = of(name, next);
                    next += 1;
                    s.prompt_len = prompt;
                    if next.is_multiple_of(2) {
                        s.req.tier = "t".into();
                    }
                    let backlogged = |p: &FairShare, live: &[(Sequence, usize)], id: u32| {
                        live.iter().any(|(q, _)| {
                            q.tenant_id == id
                                && matches!(q.state, RequestState::Waiting | RequestState::Preempted)
                        }) && p.tenant(id).is_some()
                    };
                    let was = backlogged(&p, &live, s.tenant_id);
                    let others: Option<f64> = (0..3u32)
                        .filter(|&i| i != s.tenant_id && backlogged(&p, &live, i))
                        .filter_map(|i| p.tenant(i).map(Tenant::projected))
                        .reduce(f64::min);
                    arrive(&mut p, &s);
                    prop_assert!(p.vtime >= vtime);
                    vtime = p.vtime;
                    let mine = p.tenant(s.tenant_id).map(Tenant::projected).unwrap_or(0.0);
                    if !was {
                        if let Some(m) = others {
                            prop_assert!(mine >= m - 1e-6);
                        } else if p.last_left.is_some() {
                            prop_assert!(mine >= p.vtime - 1e-6);
                        }
                    }
                    live.push((s, prompt));
                }
                // A preempted request is admitted again before it is served (the planner's
                // order); a waiting one may be served without a word (admitted then).
                Op::Serve(i, prompt, out)
                    if !live.is_empty()
                        && live[i % live.len()].0.state != RequestState::Preempted =>
                {
                    let k = i % live.len();
                    let (s, left) = &mut live[k];
                    let prompt = prompt.min(*left);
                    *left -= prompt;
                    serve(&mut p, s, prompt, out);
                }
                Op::Depart(i) if !live.is_empty() => {
                    let (mut s, _) = live.remove(i % live.len());
                    depart(&mut p, &mut s);
                    prop_assert!(p.vtime >= vtime);
                    vtime = p.vtime;
                }
                Op::Admit(i) if !live.is_empty() => {
                    let k = i % live.len();
                    let s = &mut live[k].0;
                    if matches!(s.state, RequestState::Waiting | RequestState::Preempted) {
                        admit(&mut p, s);
                        prop_assert!(p.vtime >= vtime);
                        vtime = p.vtime;
                    }
                }
                Op::Preempt(i) if !live.is_empty() => {
                    let k = i % live.len();
                    let s = &mut live[k].0;
                    if s.state == RequestState::Running {
                        preempt(&mut p, s);
                    }
                }
                _ => {}
            }
            // Recompute every waiting request's rank.
            let weight = |s: &Sequence| {
                (if s.tenant_id == 1 { 3.0 } else { 1.0 })
                    * (if s.req.tier == "t" { 2.0 } else { 1.0 })
            };
            let waiting = |q: &Sequence| {
                matches!(q.state, RequestState::Waiting | RequestState::Preempted)
            };
            for (s, _) in live.iter().filter(|(s, _)| waiting(s)) {
                let t = s.tenant_id;
                let uncharged: f64 = live
                    .iter()
                    .filter(|(q, _)| q.tenant_id == t)
                    .filter(|(q, _)| {
                        matches!(q.state, RequestState::Running | RequestState::Preempted)
                            || (s.state == RequestState::Waiting
                                && q.state == RequestState::Waiting
                                && q.id.0 < s.id.0)
                    })
                    .map(|(q, left)| *left as f64 / weight(q))
                    .sum();
                let want = p.counter(t) + uncharged;
                let got = f64::from_bits(key_of(&p, s) as u64);
                prop_assert!((got - want).abs() <= 1e-6 * want.max(1.0), "{got} != {want}");
            }
        }
    }
}
