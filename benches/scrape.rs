//! The endpoint picker's load scraper at fleet scale: what reading every pod's `/metrics`
//! costs the daemon with 100 pods (GIE's 50 ms for each) and with 10,000 (the interval
//! stretched by `metricsMaxScrapesPerSecond`).
//!
//! One HTTP server in this process answers every pod's page (a vLLM-shaped page of about
//! 28 KB: the two series the picker reads among the histograms a vLLM engine reports), on
//! `0.0.0.0`, so each pod is an address of its own on loopback (`127.1.x.y`). The daemon runs
//! as a process of its own (the release binary), its picker's pool a static list of the pods.
//! After a 5 s warm-up, for `--seconds` (default 20): the daemon's CPU (user + system, from
//! `/proc`), the reads made (`kvindexer_picker_scrapes_total{result="ok"}`), the stretched
//! period and the resident memory. Each arm in a fresh process, the arms alternated over
//! `--rounds` (default 3) rounds; medians printed.
//!
//! `cargo bench --bench scrape [-- --seconds S --rounds R --pods 100,10000]`

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;

/// A vLLM-shaped metrics page of `pods`' engine: the two series the picker reads, and
/// histograms as vLLM's engine reports them (their buckets are most of a real page).
fn page() -> String {
    let mut out = String::from(
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 3.0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 0.42\n",
    );
    let buckets = [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ];
    for name in [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "iteration_tokens_total",
        "request_max_num_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
        "time_per_output_token_seconds",
    ] {
        out.push_str(&format!("# TYPE vllm:{name} histogram\n"));
        for le in buckets {
            out.push_str(&format!(
                "vllm:{name}_bucket{{engine=\"0\",le=\"{le}\",model_name=\"Qwen/Qwen3-8B\"}} 1234.0\n"
            ));
        }
        out.push_str(&format!(
            "vllm:{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"Qwen/Qwen3-8B\"}} 1234.0\n\
             vllm:{name}_count{{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"}} 1234.0\n\
             vllm:{name}_sum{{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"}} 5678.0\n"
        ));
    }
    out
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Pod `i`'s address: `127.1.x.y:port`.
fn pod(i: usize, port: u16) -> String {
    format!("127.1.{}.{}:{port}", i / 250, i % 250 + 1)
}

/// The daemon's CPU seconds so far (user + system) and resident bytes.
fn usage(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 (1-based, from the pid): 11 and 12 after ')'.
    let cpu = (ticks(11) + ticks(12)) / 100.0;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024;
    (cpu, rss)
}

/// A metric's value on the daemon's page (0 when absent).
async fn metric(client: &reqwest::Client, port: u16, name: &str) -> f64 {
    let url = format!("http://127.0.0.1:{port}/metrics");
    let page = match client.get(url).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    page.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// One arm's figures.
#[derive(Debug, Clone, Copy)]
struct Figures {
    reads_per_s: f64,
    cpu_cores: f64,
    us_per_read: f64,
    period_ms: f64,
    rss_mib: f64,
}

/// The daemon with `pods` pods for `seconds` (after a 5 s warm-up).
async fn arm(pods: usize, page_port: u16, seconds: u64, dir: &std::path::Path) -> Figures {
    let (grpc, http, picker) = (free_port(), free_port(), free_port());
    let endpoints: Vec<String> = (0..pods)
        .map(|i| format!("\"{}\"", pod(i, page_port)))
        .collect();
    let config = format!(
        "kvEventsConfig: {{zmqEndpoint: \"tcp://127.0.0.1:{}\"}}\n\
         server: {{grpcAddr: \"127.0.0.1:{grpc}\", metricsAddr: \"127.0.0.1:{http}\"}}\n\
         endpointPicker:\n  enabled: true\n  addr: \"127.0.0.1:{picker}\"\n  tls: {{mode: plaintext}}\n  endpoints: [{}]\n",
        free_port(),
        endpoints.join(", ")
    );
    let path = dir.join(format!("scrape-{pods}.yaml"));
    std::fs::write(&path, config).expect("config written");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("kv-indexer starts");
    let pid = child.id();
    let client = reqwest::Client::new();
    let ok = "kvindexer_picker_scrapes_total{result=\"ok\"}";
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (cpu0, _) = usage(pid);
    let reads0 = metric(&client, http, ok).await;
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let (cpu1, rss) = usage(pid);
    let reads1 = metric(&client, http, ok).await;
    let elapsed = start.elapsed().as_secs_f64();
    let period_ms = metric(&client, http, "kvindexer_picker_scrape_period_milliseconds").await;
    let _ = child.kill();
    let _ = child.wait();
    let reads = reads1 - reads0;
    let cpu = cpu1 - cpu0;
    Figures {
        reads_per_s: reads / elapsed,
        cpu_cores: cpu / elapsed,
        us_per_read: if reads > 0.0 { cpu / reads * 1e6 } else { 0.0 },
        period_ms,
        rss_mib: rss as f64 / (1 << 20) as f64,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seconds: u64 = arg(&args, "--seconds")
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let rounds: usize = arg(&args, "--rounds")
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let fleets: Vec<usize> = arg(&args, "--pods")
        .unwrap_or_else(|| "100,10000".into())
        .split(',')
        .filter_map(|p| p.parse().ok())
        .collect();
    let body = page();
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], 0)))
        .await
        .expect("binds");
    let page_port = listener.local_addr().expect("addr").port();
    let app = Router::new().fallback(get(move || {
        let body = body.clone();
        async move { body }
    }));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    println!(
        "page: {} bytes; {seconds} s timed per arm; {rounds} rounds",
        page().len()
    );
    let dir = std::env::temp_dir().join(format!("kv-indexer-scrape-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let mut results: Vec<Vec<Figures>> = vec![Vec::new(); fleets.len()];
    for round in 0..rounds {
        // Alternated: each round starts with another arm.
        for k in 0..fleets.len() {
            let i = (k + round) % fleets.len();
            let f = arm(fleets[i], page_port, seconds, &dir).await;
            println!("round {round} pods {:>6}: {f:?}", fleets[i]);
            results[i].push(f);
        }
    }
    println!("\nmedians of {rounds} rounds:");
    println!("| pods | reads/s | period ms | daemon CPU (cores) | CPU us per read | RSS MiB |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for (pods, runs) in fleets.iter().zip(&results) {
        let m = |f: fn(&Figures) -> f64| median(runs.iter().map(f).collect());
        println!(
            "| {pods} | {:.0} | {:.0} | {:.3} | {:.1} | {:.0} |",
            m(|f| f.reads_per_s),
            m(|f| f.period_ms),
            m(|f| f.cpu_cores),
            m(|f| f.us_per_read),
            m(|f| f.rss_mib)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
