//! The Edgefleet API against a real kube-apiserver: the CRDs install, the
//! schema accepts what it should and refuses what it should with messages a
//! person can act on, status is a subresource, and the printer columns show.

use std::collections::BTreeMap;

use edgefleet_shared::PropertyValue;
use edgefleet_shared::api::{
    Device, DevicePhase, DeviceSpec, DeviceStatus, EdgeNode, FirmwareSpec, Transport, crds,
};
use edgefleet_tests::{FIELD_MANAGER, assert_refused, control_plane, table, test_namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Api, Client, Resource};
use serde_json::{Value, json};

fn thermostat_spec(node: &str) -> DeviceSpec {
    DeviceSpec {
        node: node.into(),
        model: "thermostat".into(),
        transport: Transport::Coap,
        desired: BTreeMap::from([
            ("setpoint".to_owned(), PropertyValue::Float(21.5)),
            ("fan".to_owned(), PropertyValue::Bool(true)),
            ("mode".to_owned(), PropertyValue::String("auto".into())),
            ("interval".to_owned(), PropertyValue::Int(10)),
        ]),
        firmware: Some(FirmwareSpec {
            version: "1.4.2".into(),
            url: Some("https://firmware.example/thermostat-1.4.2.bin".into()),
            sha256: Some("0123456789abcdef".repeat(4)),
        }),
        retry: 0,
    }
}

/// Creates a Device from raw JSON, so tests can send what the Rust types
/// would never produce.
async fn create_raw(
    client: &Client,
    ns: &str,
    name: &str,
    spec: Value,
) -> Result<DynamicObject, kube::Error> {
    let resource = ApiResource::erase::<Device>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &resource);
    let obj = DynamicObject::new(name, &resource).data(json!({ "spec": spec }));
    api.create(&PostParams::default(), &obj).await
}

fn valid_spec_json() -> Value {
    serde_json::to_value(thermostat_spec("edge-1")).unwrap()
}

#[tokio::test]
async fn crds_install_and_become_established() {
    let client = control_plane().client().await;
    let api: Api<CustomResourceDefinition> = Api::all(client);
    for crd in crds() {
        let name = crd.metadata.name.unwrap();
        let live = api.get(&name).await.unwrap();
        let conditions = live.status.and_then(|s| s.conditions).unwrap_or_default();
        let established = conditions
            .iter()
            .find(|c| c.type_ == "Established")
            .unwrap_or_else(|| panic!("{name} has no Established condition: {conditions:?}"));
        assert_eq!(established.status, "True", "{name}: {established:?}");
    }
}

#[tokio::test]
async fn a_valid_device_is_accepted_and_read_back() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "valid-device").await;
    let api: Api<Device> = Api::namespaced(client, &ns);

    let device = Device::new("thermostat-1", thermostat_spec("edge-1"));
    api.create(&PostParams::default(), &device).await.unwrap();

    let read = api.get("thermostat-1").await.unwrap();
    assert_eq!(read.spec, device.spec);
    assert_eq!(read.meta().generation, Some(1));
    assert!(read.meta().uid.is_some());
}

#[tokio::test]
async fn invalid_devices_are_refused_with_actionable_messages() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "invalid-devices").await;

    // (what is wrong, how to break a valid spec, words the refusal must contain)
    type Breaker = fn(&mut Value);
    let cases: Vec<(&str, Breaker, Vec<&str>)> = vec![
        (
            "unknown transport",
            |s| s["transport"] = json!("zigbee"),
            vec![
                "spec.transport",
                "Unsupported value",
                "\"zigbee\"",
                "\"coap\"",
                "\"mqtt\"",
            ],
        ),
        (
            "missing transport",
            |s| {
                s.as_object_mut().unwrap().remove("transport");
            },
            vec!["spec.transport", "Required value"],
        ),
        (
            "a property that is an object",
            |s| s["desired"]["setpoint"] = json!({"value": 21}),
            vec![
                "spec.desired",
                "property values must be a bool, an integer, a float or a string",
            ],
        ),
        (
            "a property that is a list",
            |s| s["desired"]["fan"] = json!([true, false]),
            vec!["spec.desired", "property values must be"],
        ),
        (
            "a property name that starts with a digit",
            |s| s["desired"]["1setpoint"] = json!(20),
            vec!["spec.desired", "property names start with a letter"],
        ),
        (
            "a firmware version with a leading v",
            |s| s["firmware"]["version"] = json!("v1.4.2"),
            vec!["spec.firmware.version", "semantic version like 1.4.2"],
        ),
        (
            "a firmware version with two parts",
            |s| s["firmware"]["version"] = json!("1.4"),
            vec!["spec.firmware.version", "semantic version"],
        ),
        (
            "a firmware url without a sha256",
            |s| {
                s["firmware"].as_object_mut().unwrap().remove("sha256");
            },
            vec!["spec.firmware", "needs a sha256"],
        ),
        (
            "a firmware url that is not http(s)",
            |s| s["firmware"]["url"] = json!("ftp://firmware.example/t.bin"),
            vec!["spec.firmware.url", "http or https URL"],
        ),
        (
            "a sha256 that is not hex",
            |s| s["firmware"]["sha256"] = json!("not-a-digest"),
            vec!["spec.firmware.sha256"],
        ),
        (
            "a node name that is not a Kubernetes node name",
            |s| s["node"] = json!("Edge_1"),
            vec!["spec.node"],
        ),
        (
            "a property name with a space",
            |s| s["desired"]["set point"] = json!("21"),
            vec!["property names start with a letter"],
        ),
    ];

    for (i, (what, break_it, expected)) in cases.into_iter().enumerate() {
        let mut spec = valid_spec_json();
        break_it(&mut spec);
        assert_refused(
            create_raw(&client, &ns, &format!("bad-{i}"), spec).await,
            what,
            &expected,
        );
    }

    // The valid spec the cases started from is accepted, so each refusal
    // above is down to the one thing that case broke.
    create_raw(&client, &ns, "good", valid_spec_json())
        .await
        .unwrap();
}

#[tokio::test]
async fn writing_status_does_not_bump_the_generation() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "status-generation").await;
    let api: Api<Device> = Api::namespaced(client, &ns);
    api.create(
        &PostParams::default(),
        &Device::new("d1", thermostat_spec("edge-1")),
    )
    .await
    .unwrap();

    let status = DeviceStatus {
        observed_generation: Some(1),
        delivered_generation: Some(1),
        applied_generation: Some(1),
        reported: BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(20.75))]),
        firmware_version: Some("1.4.2".into()),
        phase: Some(DevicePhase::Applied),
        ..Default::default()
    };
    let patch = json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "Device",
        "status": status,
    });
    api.patch_status(
        "d1",
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&patch),
    )
    .await
    .unwrap();

    let read = api.get("d1").await.unwrap();
    assert_eq!(
        read.meta().generation,
        Some(1),
        "a status write moved the generation"
    );
    assert_eq!(read.status.as_ref(), Some(&status));

    // A spec change does move it: the check above is not vacuous.
    let mut spec = read.spec.clone();
    spec.desired
        .insert("setpoint".into(), PropertyValue::Float(19.0));
    let patch = json!({ "apiVersion": "edgefleet.io/v1alpha1", "kind": "Device", "spec": spec });
    api.patch(
        "d1",
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .unwrap();
    let read = api.get("d1").await.unwrap();
    assert_eq!(read.meta().generation, Some(2));
    assert_eq!(read.status.and_then(|s| s.applied_generation), Some(1));
}

/// The controller's status writes test the object's uid (a JSON Patch
/// `test`; server-side apply ignores `metadata.uid`); the API server refuses
/// such a write once the Device was deleted and created again under the
/// same name, so a late write never lands on the new object.
#[tokio::test]
async fn a_status_write_naming_the_uid_is_refused_by_a_recreated_device() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "status-uid").await;
    let api: Api<Device> = Api::namespaced(client, &ns);
    let create = || async {
        api.create(
            &PostParams::default(),
            &Device::new("d1", thermostat_spec("edge-1")),
        )
        .await
        .unwrap()
        .meta()
        .uid
        .clone()
        .unwrap()
    };
    let write = |uid: String| {
        let api = api.clone();
        async move {
            let patch: json_patch::Patch = serde_json::from_value(json!([
                { "op": "test", "path": "/metadata/uid", "value": uid },
                { "op": "add", "path": "/status", "value": { "deliveredGeneration": 1 } },
            ]))
            .unwrap();
            api.patch_status(
                "d1",
                &PatchParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..Default::default()
                },
                &Patch::Json::<()>(patch),
            )
            .await
        }
    };
    let old = create().await;
    write(old.clone()).await.expect("the right uid is accepted");
    api.delete("d1", &Default::default()).await.unwrap();
    let new = create().await;
    match write(old).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 422, "{status:?}"),
        other => panic!("a write naming the old uid landed: {other:?}"),
    }
    let read = api.get("d1").await.unwrap();
    assert_eq!(read.status.and_then(|s| s.delivered_generation), None);
    write(new)
        .await
        .expect("the new object's own uid is accepted");
}

#[tokio::test]
async fn spec_writes_through_the_main_resource_cannot_change_status() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "status-subresource").await;
    let api: Api<Device> = Api::namespaced(client, &ns);
    let mut device = Device::new("d1", thermostat_spec("edge-1"));
    device.status = Some(DeviceStatus {
        phase: Some(DevicePhase::Applied),
        ..Default::default()
    });
    api.create(&PostParams::default(), &device).await.unwrap();
    let read = api.get("d1").await.unwrap();
    assert_eq!(
        read.status.and_then(|s| s.phase),
        None,
        "status must only be written through /status"
    );
}

#[tokio::test]
async fn kubectl_get_devices_shows_node_model_firmware_phase_age() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "printer-columns").await;
    let api: Api<Device> = Api::namespaced(client.clone(), &ns);
    api.create(
        &PostParams::default(),
        &Device::new("t1", thermostat_spec("edge-7")),
    )
    .await
    .unwrap();
    let status = json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "Device",
        "status": {
            "firmwareVersion": "1.4.1",
            "phase": "Delivered",
            "appliedGeneration": 0,
            "rollout": {
                "name": "fw-1-4-1",
                "revision": 1,
                "state": "Updating",
                "attempt": 2,
                "failure": "TimedOut",
            },
        },
    });
    api.patch_status(
        "t1",
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&status),
    )
    .await
    .unwrap();

    let (columns, rows) = table(
        &client,
        &format!("/apis/edgefleet.io/v1alpha1/namespaces/{ns}/devices"),
    )
    .await;
    assert_eq!(
        columns,
        [
            "Name",
            "Node",
            "Model",
            "Firmware",
            "Phase",
            "Age",
            "Transport",
            "Applied",
            "Rollout",
            "Rollout-State",
            "Attempt",
            "Failure"
        ]
    );
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(
        row[..5],
        [
            json!("t1"),
            json!("edge-7"),
            json!("thermostat"),
            json!("1.4.1"),
            json!("Delivered")
        ]
    );
    assert!(
        row[5].as_str().is_some_and(|age| age.ends_with('s')),
        "age: {}",
        row[5]
    );
    assert_eq!(row[6], json!("coap"));
    assert_eq!(
        row[8..12],
        [
            json!("fw-1-4-1"),
            json!("Updating"),
            json!(2),
            json!("TimedOut")
        ],
        "-o wide: the device's rollout"
    );
    assert_eq!(row[7], json!(0));
}

#[tokio::test]
async fn edge_nodes_are_cluster_scoped_and_show_readiness() {
    let client = control_plane().client().await;
    let api: Api<EdgeNode> = Api::all(client.clone());
    let name = format!("edge-columns-{}", std::process::id());
    api.create(
        &PostParams::default(),
        &EdgeNode::new(&name, Default::default()),
    )
    .await
    .unwrap();
    let status = json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "EdgeNode",
        "status": {
            "connected": true,
            "agentVersion": "0.1.0",
            "deviceCount": 12,
            "outboxDepth": 3,
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "Connected",
                "message": "agent connected", "lastTransitionTime": "2026-01-01T00:00:00Z",
            }],
        },
    });
    api.patch_status(
        &name,
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&status),
    )
    .await
    .unwrap();

    let (columns, rows) = table(&client, "/apis/edgefleet.io/v1alpha1/edgenodes").await;
    assert_eq!(
        columns,
        [
            "Name",
            "Ready",
            "Agent",
            "Devices",
            "Outbox",
            "Heartbeat",
            "Age"
        ]
    );
    let row = rows
        .iter()
        .find(|r| r[0] == json!(name))
        .expect("our EdgeNode is listed");
    assert_eq!(
        row[1..5],
        [json!("True"), json!("0.1.0"), json!(12), json!(3)]
    );

    // A negative count is refused.
    let bad = json!({
        "apiVersion": "edgefleet.io/v1alpha1", "kind": "EdgeNode",
        "status": { "outboxDepth": -1 },
    });
    let err = api
        .patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(&bad),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("status.outboxDepth"), "{err}");
}
