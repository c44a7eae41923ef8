//! Prefill/decode disaggregation behind a real Envoy (1.40, `ENVOY_BIN`; `.ci/run` installs it)
//! running the gateway configuration the project ships (`deploy/examples/envoy.yaml`): a
//! client's request goes through Envoy, whose ext_proc filter asks the daemon's picker, to the
//! fake decode pod, which records the headers it received (as llm-d's routing sidecar in front
//! of it would read them). Without Envoy the test says `SKIPPED` (under `CI=true` it fails).
//! `tests/pd_split.rs` runs the decisions over the ext_proc client alone.
//!
//! - a long prompt a prefill pod holds reaches the decode pod with exactly one
//!   `x-prefiller-host-port` line naming that pod, although the client sent its own;
//! - a prompt the decode pod holds almost whole reaches it without the header: the client's is
//!   removed; control: another header the client sent does arrive, so the removal is the
//!   picker's, not Envoy's.

mod support;

use kv_indexer::config::{PdConfig, RoledEndpoint, StaticEndpoint};
use serde_json::json;
use support::envoy::{binary, config, Envoy, COMPLETIONS};
use support::picker::{FakePod, Fleet, MODEL};
use support::pool::prompt;

const PREFILLER: &str = "x-prefiller-host-port";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_the_decode_pod_gets_the_prefiller_we_chose_and_no_other() {
    let Some(bin) = binary() else { return };
    let d = FakePod::start().await;
    let p = FakePod::start().await;
    let mut c = support::picker::config(None);
    c.endpoint_picker.endpoints = vec![
        StaticEndpoint::from(d.name.as_str()),
        StaticEndpoint::WithRole(RoledEndpoint {
            address: p.name.clone(),
            role: Some("prefill".into()),
        }),
    ];
    c.endpoint_picker.pd = PdConfig {
        threshold: 40,
        min_prompt_tokens: 0,
    };
    let mut fleet = Fleet::start(c).await;
    let long = prompt(70, 8);
    let mut held = prompt(71, 8);
    fleet.store(&p.name, &long).await;
    fleet.store(&d.name, &held).await;
    held.extend(9000..9008);
    fleet.scraped(2, 2).await;
    let port = fleet.daemon.picker_addr.expect("the picker is on").port();
    let envoy = Envoy::start(&bin, &config("deploy/examples/envoy.yaml", port, &[])).await;
    let client = [(PREFILLER, "10.9.9.9:1"), ("x-client-probe", "1")];
    for (ids, want) in [(&long, vec![p.name.clone()]), (&held, vec![])] {
        let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 3}).to_string();
        let r = envoy.post_with(COMPLETIONS, body.as_bytes(), &client).await;
        assert_eq!(
            (r.status, r.served_by.as_deref()),
            (200, Some(d.name.as_str())),
            "{}",
            envoy.log()
        );
        let received = d.state().received();
        let last = received.last().expect("the decode pod got it");
        assert_eq!(last.values(PREFILLER), want, "{:?}", last.headers);
        assert_eq!(
            last.values("x-client-probe"),
            ["1"],
            "Envoy forwards client headers"
        );
    }
    assert!(
        p.state().received().is_empty(),
        "nothing is sent to the prefill pod"
    );
}
