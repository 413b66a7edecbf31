//! The shared CoAP client against scripted responders on 127.0.0.1:
//! retransmission, giving up, refusals and dispatch of concurrent answers.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use coap_lite::{MessageClass, MessageType, Packet, ResponseType};
use edgefleet_sim::coap::{CoapClient, ExchangeError, Request};
use edgefleet_sim::retransmit::RetransmitParams;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

/// Short timeouts, no randomness: a schedule of 40, 80, 160 ms.
fn fast() -> RetransmitParams {
    RetransmitParams {
        ack_timeout: Duration::from_millis(40),
        ack_random_factor: 1.0,
        max_retransmit: 2,
    }
}

fn ack(request: &Packet, code: ResponseType, payload: Vec<u8>) -> Vec<u8> {
    let mut ack = Packet::new();
    ack.header.set_type(MessageType::Acknowledgement);
    ack.header.code = MessageClass::Response(code);
    ack.header.message_id = request.header.message_id;
    ack.set_token(request.get_token().to_vec());
    ack.payload = payload;
    ack.to_bytes().unwrap()
}

/// A responder that hands every request it receives to `script`, which
/// returns the datagram to answer with (or `None` to drop the request).
/// Every request received is also passed on through the channel.
async fn responder(
    mut script: impl FnMut(&Packet) -> Option<Vec<u8>> + Send + 'static,
) -> (SocketAddr, mpsc::UnboundedReceiver<Packet>) {
    let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let addr = socket.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        loop {
            let (len, peer) = socket.recv_from(&mut buf).await.unwrap();
            let request = Packet::from_bytes(&buf[..len]).unwrap();
            let answer = script(&request);
            // Recorded before answering, so the client never sees an answer
            // to a request the test has not been told about.
            let _ = tx.send(request);
            if let Some(answer) = answer {
                socket.send_to(&answer, peer).await.unwrap();
            }
        }
    });
    (addr, rx)
}

async fn client(agent: SocketAddr) -> CoapClient {
    CoapClient::connect(agent, 1000, 1).await.unwrap()
}

#[tokio::test]
async fn a_lost_request_is_retransmitted_with_the_same_message_id() {
    let mut seen = 0;
    let (agent, mut requests) = responder(move |request| {
        seen += 1;
        (seen == 3).then(|| ack(request, ResponseType::Changed, vec![]))
    })
    .await;
    let client = client(agent).await;

    let exchange = client
        .request(
            &Request::report("ns", "d1", vec![0xa0]),
            fast().start_with_factor(1.0),
        )
        .await;

    assert_eq!(exchange.retransmissions, 2);
    let response = exchange.result.unwrap();
    assert!(response.is_success());
    let ids: Vec<_> = (0..3)
        .map(|_| requests.try_recv().unwrap().header.message_id)
        .collect();
    assert_eq!(ids, [1000, 1000, 1000]);
}

#[tokio::test]
async fn an_unanswered_request_fails_after_the_last_timeout() {
    let (agent, mut requests) = responder(|_| None).await;
    let client = client(agent).await;

    let started = Instant::now();
    let exchange = client
        .request(
            &Request::report("ns", "d1", vec![0xa0]),
            fast().start_with_factor(1.0),
        )
        .await;

    assert_eq!(exchange.result, Err(ExchangeError::Timeout(2)));
    assert_eq!(exchange.retransmissions, 2);
    // 40 + 80 + 160 ms of waiting, give or take the scheduler.
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(280), "{took:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    let mut sent = 0;
    while requests.try_recv().is_ok() {
        sent += 1;
    }
    assert_eq!(sent, 3, "one transmission and two retransmissions");
}

#[tokio::test]
async fn a_refusal_comes_back_with_its_code() {
    let (agent, _requests) = responder(|request| {
        Some(ack(
            request,
            ResponseType::NotFound,
            b"unknown device".to_vec(),
        ))
    })
    .await;
    let client = client(agent).await;

    let exchange = client
        .request(
            &Request::report("ns", "ghost", vec![0xa0]),
            fast().start_with_factor(1.0),
        )
        .await;

    let response = exchange.result.unwrap();
    assert!(!response.is_success());
    assert_eq!(response.code.to_string(), "4.04");
    assert_eq!(response.payload, b"unknown device");
    assert_eq!(exchange.retransmissions, 0);
}

#[tokio::test]
async fn a_reset_ends_the_exchange() {
    let (agent, _requests) = responder(|request| {
        let mut reset = Packet::new();
        reset.header.set_type(MessageType::Reset);
        reset.header.message_id = request.header.message_id;
        Some(reset.to_bytes().unwrap())
    })
    .await;
    let client = client(agent).await;
    let exchange = client
        .request(
            &Request::report("ns", "d1", vec![0xa0]),
            fast().start_with_factor(1.0),
        )
        .await;
    assert_eq!(exchange.result, Err(ExchangeError::Reset));
}

#[tokio::test]
async fn concurrent_answers_reach_their_own_requests() {
    const N: usize = 20;
    // Hold every request back, then answer them all in reverse order, each
    // with its own payload echoed; plus a stray answer with a wrong token.
    let (agent_socket, agent) = {
        let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = socket.local_addr().unwrap();
        (socket, addr)
    };
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        let mut held = Vec::new();
        let mut peer = None;
        while held.len() < N {
            let (len, from) = agent_socket.recv_from(&mut buf).await.unwrap();
            peer = Some(from);
            held.push(Packet::from_bytes(&buf[..len]).unwrap());
        }
        let peer = peer.unwrap();
        let mut stray = held[0].clone();
        stray.set_token(vec![0xde, 0xad, 0xbe, 0xef]);
        let stray = ack(&stray, ResponseType::Changed, b"stray".to_vec());
        agent_socket.send_to(&stray, peer).await.unwrap();
        for request in held.iter().rev() {
            let answer = ack(request, ResponseType::Changed, request.payload.clone());
            agent_socket.send_to(&answer, peer).await.unwrap();
        }
    });

    let client = Arc::new(client(agent).await);
    let params = RetransmitParams {
        // Long enough that nothing is retransmitted while requests are held.
        ack_timeout: Duration::from_secs(5),
        ..fast()
    };
    let exchanges: Vec<_> = (0..N)
        .map(|i| {
            let client = Arc::clone(&client);
            tokio::spawn(async move {
                let request = Request::report("ns", &format!("d{i}"), vec![i as u8 + 1]);
                client
                    .request(&request, params.start_with_factor(1.0))
                    .await
            })
        })
        .collect();
    for (i, exchange) in exchanges.into_iter().enumerate() {
        let exchange = timeout(Duration::from_secs(10), exchange)
            .await
            .expect("answered in time")
            .unwrap();
        assert_eq!(exchange.retransmissions, 0);
        assert_eq!(
            exchange.result.unwrap().payload,
            [i as u8 + 1],
            "request {i}"
        );
    }
}
