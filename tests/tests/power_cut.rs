//! Power cuts: the agent's store on a file system that forgets whatever was
//! not synced (`edgefleet_tests::powercut_fs`), the power cut at seeded
//! random moments while 50 devices report and raise events over CoAP as
//! fast as the agent acknowledges them. After each cut no acknowledged
//! report or event may be missing: a device is told `2.04` only once its
//! message is durable, so a cut must not take it back.
//!
//! The agent runs as a real process with no cloud (it keeps serving its
//! devices offline, so nothing leaves the outbox); its Devices are put in
//! its store the way the sync client does, with `Store::apply`. Each round:
//! start the agent on the mount, let the devices hammer it, freeze the file
//! system (the disk stops: every operation fails from then on), SIGKILL the
//! agent and wait for it, cut the power, then open the store in the test
//! (as the restarted agent would, a store moved aside as corrupt or an
//! entry dropped as unreadable being a loss too) and check every
//! acknowledgement so far.
//!
//! The seed is printed; `EDGEFLEET_POWERCUT_SEED=N` replays the choice of
//! moments and `EDGEFLEET_POWERCUT_CUTS=N` sets the number of cuts (5).
//!
//! The first tests check the file system's model itself.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use edgefleet_agent::store::{DesiredDevice, PendingUplink, Store};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{self, DeviceEvent, EventAck};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion};
use edgefleet_sim::coap::{CoapClient, Request};
use edgefleet_sim::retransmit::RetransmitParams;
use edgefleet_tests::powercut_fs::{CutReport, PowerCutFs};
use edgefleet_tests::process::{Process, free_tcp_addr, free_udp_addr, http_get};
use edgefleet_tests::{READING, numbered_report};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn mount() -> PowerCutFs {
    PowerCutFs::mount().unwrap_or_else(|e| panic!("the power-cut file system: {e:#}"))
}

fn sync_dir(dir: &Path) {
    File::open(dir).unwrap().sync_all().unwrap();
}

fn read(path: &Path) -> Option<Vec<u8>> {
    match std::fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => panic!("read {}: {e}", path.display()),
    }
}

/// Cuts the power the way the test below does: frozen, cut, thawed.
fn cut(fs: &PowerCutFs) -> CutReport {
    fs.freeze();
    let report = fs.power_cut();
    fs.thaw();
    report
}

#[test]
fn a_synced_write_survives_a_cut_and_an_unsynced_one_is_lost() {
    let fs = mount();
    let path = fs.path().join("f");
    let mut f = File::create(&path).unwrap();
    f.write_all(b"durable").unwrap();
    f.sync_data().unwrap();
    sync_dir(fs.path());
    // Written, even closed, but not synced.
    f.write_all(b" and more").unwrap();
    drop(f);
    assert_eq!(read(&path).unwrap(), b"durable and more");

    let report = cut(&fs);
    assert_eq!(read(&path).unwrap(), b"durable");
    assert_eq!(report.bytes_forgotten, 9, "{report:?}");
    assert_eq!(fs.stats().fsyncs, 1);
    assert_eq!(fs.stats().fsyncdirs, 1);

    // An overwrite in place and a truncation, not synced: both undone.
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all(b"DUR").unwrap();
    f.set_len(5).unwrap();
    drop(f);
    assert_eq!(read(&path).unwrap(), b"DURab");
    let report = cut(&fs);
    assert_eq!(read(&path).unwrap(), b"durable");
    assert_eq!(report.bytes_forgotten, 3 + 2, "{report:?}");
}

#[test]
fn a_file_whose_directory_was_not_synced_is_gone_after_a_cut() {
    let fs = mount();
    let dir = fs.path().join("store");
    std::fs::create_dir(&dir).unwrap();
    sync_dir(fs.path());
    let path = dir.join("db");
    let mut f = File::create(&path).unwrap();
    f.write_all(&[7; 10_000]).unwrap();
    // The file's own sync does not make its name durable.
    f.sync_all().unwrap();
    drop(f);

    let report = cut(&fs);
    assert!(dir.is_dir(), "the directory's name was synced");
    assert_eq!(read(&path), None, "the file's name was not");
    assert_eq!(report.inodes_dropped, 1, "{report:?}");
    assert_eq!(report.bytes_forgotten, 10_000, "{report:?}");
    assert!(
        report.changed.iter().any(|c| c.contains("/store/db")),
        "{report:?}"
    );

    // With its directory synced it stays, unlinked or not: an unlink that
    // was not synced is undone too.
    std::fs::write(&path, b"x").unwrap();
    File::open(&path).unwrap().sync_all().unwrap();
    sync_dir(&dir);
    std::fs::remove_file(&path).unwrap();
    cut(&fs);
    assert_eq!(read(&path).unwrap(), b"x");
}

#[test]
fn a_rename_whose_directory_was_not_synced_is_undone_by_a_cut() {
    let fs = mount();
    let (old, new) = (fs.path().join("snap.generating"), fs.path().join("snap"));
    std::fs::write(&new, b"old snapshot").unwrap();
    File::open(&new).unwrap().sync_all().unwrap();
    std::fs::write(&old, b"new snapshot").unwrap();
    File::open(&old).unwrap().sync_all().unwrap();
    sync_dir(fs.path());

    // Replaces `snap`; not durable until the directory is synced.
    std::fs::rename(&old, &new).unwrap();
    assert_eq!(read(&new).unwrap(), b"new snapshot");
    let report = cut(&fs);
    assert_eq!(read(&new).unwrap(), b"old snapshot");
    assert_eq!(read(&old).unwrap(), b"new snapshot");
    assert_eq!(report.entries_reverted, 2, "{report:?}");

    std::fs::rename(&old, &new).unwrap();
    sync_dir(fs.path());
    cut(&fs);
    assert_eq!(read(&new).unwrap(), b"new snapshot");
    assert_eq!(read(&old), None);
}

#[test]
fn a_frozen_file_system_refuses_everything() {
    let fs = mount();
    let path = fs.path().join("f");
    std::fs::write(&path, b"x").unwrap();
    fs.freeze();
    let error = File::open(&path).and_then(|mut f| {
        let mut s = String::new();
        f.read_to_string(&mut s)
    });
    assert_eq!(error.unwrap_err().raw_os_error(), Some(5), "EIO");
    fs.thaw();
    assert_eq!(read(&path).unwrap(), b"x");
    assert!(fs.stats().refused_frozen > 0);
}

// The agent under power cuts.

const DEVICES: usize = 50;
const CUTS: u32 = 5;
const NAMESPACE: &str = "plant";
/// The agent may drop events at its outbox bound; set far above what the
/// test sends, so any missing event is a loss.
const OUTBOX_MAX_EVENTS: u64 = 10_000_000;
/// Every third message of a device is an event.
const EVENT_EVERY: u64 = 3;

fn key(i: usize) -> ResourceKey {
    ResourceKey::device(NAMESPACE, device_name(i))
}

fn device_name(i: usize) -> String {
    format!("pc-{i:03}")
}

/// What the agent acknowledged to one device so far.
#[derive(Clone, Debug, Default)]
struct Acked {
    /// The value of the last acknowledged report: reports carry 1, 2, 3, …
    /// and a device sends the next only once the last was acknowledged.
    last_report: i64,
    /// Acknowledged event ids, in order (1, 2, 3, …).
    events: Vec<u64>,
    /// Answers other than success, by code: `4.04` for a device whose
    /// Device the agent lost, `5.00` for a store that failed (as it does
    /// while the disk is frozen for a cut).
    refusals: BTreeMap<String, u64>,
    /// Event acknowledgements naming another id than the one sent.
    odd_event_acks: u64,
}

type Ledger = Arc<Mutex<Vec<Acked>>>;

fn report_payload(value: i64) -> Vec<u8> {
    codec::encode(&numbered_report(value)).unwrap()
}

fn event_payload(id: u64) -> Vec<u8> {
    codec::encode(&DeviceEvent {
        id,
        // A device that keeps its event counter for good.
        boot: 0,
        warning: false,
        reason: "SelfCheck".into(),
        message: format!("check {id}"),
    })
    .unwrap()
}

/// One device: reports 1, 2, 3, … with an event every third message, each
/// sent again (the same content) until acknowledged, the next one as soon
/// as it is. Never two different messages in flight, so a newer report can
/// never be overtaken by an older one.
async fn run_device(
    i: usize,
    agent: SocketAddr,
    first_id: u16,
    ledger: Ledger,
    stop: Arc<AtomicBool>,
) {
    let client = CoapClient::connect(agent, first_id, (i as u32) << 24)
        .await
        .expect("device socket");
    // Short timeouts: after a cut the agent is back within a second.
    let params = RetransmitParams {
        ack_timeout: Duration::from_millis(200),
        ack_random_factor: 1.0,
        max_retransmit: 1,
    };
    let name = device_name(i);
    let (mut value, mut event_id, mut sent) = (1i64, 1u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        let is_event = sent % EVENT_EVERY == EVENT_EVERY - 1;
        let request = match is_event {
            true => Request::event(NAMESPACE, &name, event_payload(event_id)),
            false => Request::report(NAMESPACE, &name, report_payload(value)),
        };
        let exchange = client
            .request(&request, params.start_with_factor(1.0))
            .await;
        match exchange.result {
            Ok(response) if response.is_success() => {
                let mut ledger = ledger.lock().unwrap();
                let acked = &mut ledger[i];
                if is_event {
                    match codec::decode::<EventAck>(&response.payload) {
                        Ok(ack) if ack.id == event_id => {}
                        _ => acked.odd_event_acks += 1,
                    }
                    acked.events.push(event_id);
                    event_id += 1;
                } else {
                    acked.last_report = value;
                    value += 1;
                }
                sent += 1;
            }
            Ok(response) => {
                *ledger.lock().unwrap()[i]
                    .refusals
                    .entry(response.code.to_string())
                    .or_default() += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // No answer (the agent is down or restarting): send it again.
            Err(_) => {}
        }
    }
}

/// What one look at the store found.
#[derive(Debug, Default)]
struct Checked {
    reports_acked: u64,
    events_acked: u64,
    /// Each loss, in words.
    losses: Vec<String>,
    reports_lost: u64,
    events_lost: u64,
}

/// Opens the store as the agent would and checks every acknowledgement in
/// `acked` against it.
fn check_store(dir: &Path, acked: &[Acked]) -> Checked {
    let mut checked = Checked {
        reports_acked: acked.iter().map(|a| a.last_report as u64).sum(),
        events_acked: acked.iter().map(|a| a.events.len() as u64).sum(),
        ..Checked::default()
    };
    let opened = match Store::open(dir) {
        Ok(opened) => opened,
        Err(e) => {
            checked
                .losses
                .push(format!("the store does not open: {e:#}"));
            return checked;
        }
    };
    if let Some((aside, reason)) = &opened.moved_aside {
        checked.losses.push(format!(
            "the store was corrupt and moved aside to {} ({reason}); salvaged {} entries",
            aside.display(),
            opened.salvage.entries
        ));
    }
    for lost in &opened.salvage.lost {
        checked
            .losses
            .push(format!("unreadable and dropped: {lost}"));
    }
    let store = opened.store;
    let held = store.device_count();
    if held != DEVICES {
        checked.losses.push(format!(
            "the store holds {held} Devices, {DEVICES} were applied (acknowledged desired state lost)"
        ));
    }
    match store.events_dropped_total() {
        Ok(0) => {}
        other => checked
            .losses
            .push(format!("events dropped at the bound: {other:?}")),
    }

    // Newest report wins: the latest is at least the last acknowledged.
    let mut behind = 0;
    for (i, a) in acked.iter().enumerate() {
        let latest = match store.latest_report(&key(i)) {
            Ok(latest) => latest,
            Err(e) => {
                checked
                    .losses
                    .push(format!("{}: report unreadable: {e}", key(i)));
                continue;
            }
        };
        let stored = latest
            .and_then(|l| l.report.properties.get(READING).cloned())
            .map_or(0, |v| match v {
                PropertyValue::Int(n) => n,
                other => panic!("{}: report {READING} = {other}", key(i)),
            });
        if stored < a.last_report {
            behind += 1;
            checked.reports_lost += (a.last_report - stored) as u64;
            if behind <= 5 {
                checked.losses.push(format!(
                    "{}: acknowledged report {} but the store's latest is {}",
                    key(i),
                    a.last_report,
                    if stored == 0 {
                        "none".into()
                    } else {
                        stored.to_string()
                    }
                ));
            }
        }
    }
    if behind > 5 {
        checked.losses.push(format!(
            "… {behind} devices in all have lost acknowledged reports"
        ));
    }

    // Every acknowledged event is in the outbox (nothing went up).
    let mut stored: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    match store.pending_uplink(0, usize::MAX) {
        Ok(pending) => {
            for (_, entry) in pending {
                if let PendingUplink::Event { device, stored: e } = entry {
                    stored
                        .entry(device.to_string())
                        .or_default()
                        .insert(e.event.id);
                }
            }
        }
        Err(e) => checked
            .losses
            .push(format!("the outbox is unreadable: {e}")),
    }
    let mut devices_missing = 0;
    for (i, a) in acked.iter().enumerate() {
        let ids = stored.remove(&key(i).to_string()).unwrap_or_default();
        let missing: Vec<u64> = a
            .events
            .iter()
            .copied()
            .filter(|id| !ids.contains(id))
            .collect();
        if !missing.is_empty() {
            devices_missing += 1;
            checked.events_lost += missing.len() as u64;
            if devices_missing <= 5 {
                checked.losses.push(format!(
                    "{}: {} acknowledged events missing from the outbox (ids {}..={}; it holds {})",
                    key(i),
                    missing.len(),
                    missing[0],
                    missing[missing.len() - 1],
                    ids.len()
                ));
            }
        }
    }
    if devices_missing > 5 {
        checked.losses.push(format!(
            "… {devices_missing} devices in all have lost acknowledged events"
        ));
    }
    checked
}

/// Starts the agent on `data_dir`, offline (its cloud address has nobody
/// listening); returns it with its metrics address.
fn start_agent(data_dir: &Path, coap: SocketAddr, log: &Path) -> (Process, SocketAddr) {
    let metrics = free_tcp_addr();
    let args = vec![
        "--node=edge-powercut".to_owned(),
        // Offline throughout: nobody listens there.
        format!("--cloud=http://{}", free_tcp_addr()),
        "--insecure-plaintext".to_owned(),
        format!("--data-dir={}", data_dir.display()),
        format!("--coap-bind={coap}"),
        // Offline from the start, it never receives device keys: plain
        // CoAP (what this test is about is the store under power cuts).
        "--insecure-coap-plain".to_owned(),
        format!("--metrics-addr={metrics}"),
        format!("--mqtt-listen={}", free_tcp_addr()),
        format!("--outbox-max-events={OUTBOX_MAX_EVENTS}"),
    ];
    let process = Process::start_logged("edgefleet-agent", &args, &[], Some(log))
        .unwrap_or_else(|e| panic!("start the agent: {e:#}"));
    (process, metrics)
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Waits until the agent serves `/healthz` (its store is open).
async fn wait_started(agent: &mut Process, metrics: SocketAddr, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Err(e) = agent.check_running() {
            panic!("{e}; its log ({}):\n{}", log.display(), log_tail(log));
        }
        if let Ok((200, _)) = http_get(metrics, "/healthz").await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not become healthy within 30 s; its log ({}):\n{}",
            log.display(),
            log_tail(log)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Lines of the agent logs that tell of a store moved aside or entries lost.
fn store_trouble_in_logs(logs: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(logs).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for line in text.lines() {
            if line.contains("the store is corrupt") || line.contains("unreadable in the store") {
                found.push(format!("{}: {line}", path.display()));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acknowledged_report_or_event_is_lost_when_the_power_is_cut() {
    let seed: u64 = edgefleet_tests::env_or("EDGEFLEET_POWERCUT_SEED", 11);
    let cuts: u32 = edgefleet_tests::env_or("EDGEFLEET_POWERCUT_CUTS", CUTS);
    eprintln!("power-cut test seed: {seed} (EDGEFLEET_POWERCUT_SEED), {cuts} cuts");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);

    // Built before anything is timed.
    edgefleet_tests::process::binary("edgefleet-agent");
    let started = Instant::now();
    let fs = mount();
    let logs = tempfile::Builder::new()
        .prefix("edgefleet-powercut-logs-")
        .tempdir()
        .unwrap();
    let data_dir: PathBuf = fs.path().to_owned();
    let store_dir = data_dir.join("store");

    // The Devices, stored as the sync client stores an Update (and then
    // acknowledges it to the cloud): durable once `apply` returns.
    {
        let store = Store::open(&store_dir).unwrap().store;
        let devices: Vec<(ResourceKey, DesiredDevice)> = (0..DEVICES)
            .map(|i| {
                let device = DesiredDevice::new(
                    ResourceVersion::new(format!("uid-{i}"), 1),
                    "meter",
                    Transport::Coap,
                    BTreeMap::new(),
                );
                (key(i), device)
            })
            .collect();
        store.apply(&devices, &[]).await.unwrap();
    }

    let coap = free_udp_addr();
    let ledger: Ledger = Arc::new(Mutex::new(vec![Acked::default(); DEVICES]));
    let stop = Arc::new(AtomicBool::new(false));
    let devices: Vec<_> = (0..DEVICES)
        .map(|i| {
            tokio::spawn(run_device(
                i,
                coap,
                rng.random(),
                Arc::clone(&ledger),
                Arc::clone(&stop),
            ))
        })
        .collect();

    let mut forgotten = Vec::new();
    let mut last = Checked::default();
    let mut acked_before = 0;
    for round in 1..=cuts {
        let log = logs.path().join(format!("agent-{round}.log"));
        let round_started = Instant::now();
        let (mut agent, metrics) = start_agent(&data_dir, coap, &log);
        wait_started(&mut agent, metrics, &log).await;
        let start_took = round_started.elapsed();
        let load = Duration::from_millis(rng.random_range(200..=1500));
        tokio::time::sleep(load).await;
        if let Err(e) = agent.check_running() {
            panic!("{e}; its log ({}):\n{}", log.display(), log_tail(&log));
        }
        // The cut. The disk stops first: from now on every operation fails,
        // as on a disk without power (the agent may still answer, but only
        // for what was synced before). In odd rounds it stops at the next
        // moment it holds something not synced (waiting at most 250 ms), so
        // cuts do land inside the agent's write-then-sync windows; in even
        // rounds right now. Then the agent dies, then the disk forgets what
        // it had not synced.
        if round % 2 == 1 {
            let deadline = Instant::now() + Duration::from_millis(250);
            while !fs.freeze_if_unsynced() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        fs.freeze();
        agent.kill();
        let report = fs.power_cut();
        fs.thaw();
        // Acknowledgements the agent sent before it died may still be on
        // their way to the devices: they count.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let acked = ledger.lock().unwrap().clone();
        let dir = store_dir.clone();
        let checked = tokio::task::spawn_blocking(move || check_store(&dir, &acked))
            .await
            .unwrap();
        let acked_now = checked.reports_acked + checked.events_acked;
        eprintln!(
            "cut {round} ({start_took:.1?} to healthy, then {load:?} of load): forgot {} bytes ({} names reverted, {} inodes gone); \
             {} reports and {} events acknowledged so far (+{} this round), {} reports and {} events lost\n  \
             undone: {}",
            report.bytes_forgotten,
            report.entries_reverted,
            report.inodes_dropped,
            checked.reports_acked,
            checked.events_acked,
            acked_now - acked_before,
            checked.reports_lost,
            checked.events_lost,
            report.changed.join(", "),
        );
        if !checked.losses.is_empty() {
            let stats = fs.stats();
            let logs = logs.keep();
            panic!(
                "seed {seed}, cut {round}: acknowledged data lost \
                 ({} of {} acknowledged reports, {} of {} acknowledged events):\n  {}\n\
                 what the cut undid:\n  {}\n\
                 the file system saw {} fsyncs and {} directory fsyncs; agent logs in {}",
                checked.reports_lost,
                checked.reports_acked,
                checked.events_lost,
                checked.events_acked,
                checked.losses.join("\n  "),
                report.changed.join("\n  "),
                stats.fsyncs,
                stats.fsyncdirs,
                logs.display()
            );
        }
        assert!(
            acked_now > acked_before,
            "cut {round}: the agent acknowledged nothing in this round (log {})",
            log.display()
        );
        acked_before = acked_now;
        forgotten.push(report.bytes_forgotten);
        last = checked;
    }
    stop.store(true, Ordering::Relaxed);
    for device in devices {
        device.abort();
    }

    let acked = ledger.lock().unwrap().clone();
    let mut refusals: BTreeMap<String, u64> = BTreeMap::new();
    for (code, n) in acked.iter().flat_map(|a| &a.refusals) {
        *refusals.entry(code.clone()).or_default() += n;
    }
    let odd: u64 = acked.iter().map(|a| a.odd_event_acks).sum();
    let stats = fs.stats();
    eprintln!(
        "{} cuts in {:.1?}: {} acknowledged reports and {} acknowledged events checked, none lost; \
         bytes forgotten per cut {forgotten:?}; {} fsyncs, {} directory fsyncs; refusals by code {refusals:?} \
         (5.00: the store failing while the disk was frozen for a cut)",
        cuts,
        started.elapsed(),
        last.reports_acked,
        last.events_acked,
        stats.fsyncs,
        stats.fsyncdirs,
    );
    let trouble = store_trouble_in_logs(logs.path());
    assert!(
        trouble.is_empty(),
        "the agent reported store trouble:\n{}",
        trouble.join("\n")
    );
    assert!(
        refusals.keys().all(|code| code == "5.00"),
        "the agent refused messages of its own devices: {refusals:?}"
    );
    assert_eq!(
        odd, 0,
        "event acknowledgements named other ids than the ones sent"
    );
    // Not vacuous: the devices got through, and the cuts discarded data.
    assert!(
        last.reports_acked >= (DEVICES as u64) * 10 && last.events_acked >= DEVICES as u64 * 3,
        "too few acknowledgements to prove anything: {} reports, {} events",
        last.reports_acked,
        last.events_acked
    );
    assert!(
        forgotten.iter().any(|&b| b > 0),
        "no cut discarded anything: the test proved nothing"
    );
    assert!(stats.fsyncs > 0, "nothing was ever synced");
}
