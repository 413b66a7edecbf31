//! Where the next sync attempt goes after a refusal: a replica that does
//! not serve this node names the one that does ([`proto::REDIRECT_METADATA`])
//! or says when to try again ([`proto::RETRY_AFTER_METADATA`]). Pure
//! bookkeeping, apart from the loop that connects.
//!
//! A redirect comes from a Lease annotation that anyone with Lease update
//! rights can edit, so it is believed only as far as the configured link
//! is: with TLS configured it must be `https` (and its certificate is
//! checked against the configured name), never a way to plaintext.

use std::time::Duration;

use edgefleet_shared::proto;

use super::{SyncError, SyncSettings};

/// What a refusal says to do next.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Advice {
    /// Connect to this replica.
    GoTo(String),
    /// Try the configured endpoint again after this long.
    RetryAfter(Duration),
    /// Nothing: back off.
    Backoff,
    /// A redirect this agent does not follow (it would leave TLS, or is
    /// not a URL): back off, and count it.
    Refused {
        /// Where it pointed.
        url: String,
        /// Why it is not followed.
        why: &'static str,
    },
}

/// What `error` advises, if it is a refusal that says; a redirect is
/// followed only to `https` when `tls` is configured (and only to `http`
/// without it, as the configured link is).
pub(super) fn advice_of(error: &SyncError, tls: bool) -> Advice {
    let SyncError::Stream(status) = error else {
        return Advice::Backoff;
    };
    if status.code() != tonic::Code::Unavailable {
        return Advice::Backoff;
    }
    let text = |key: &str| status.metadata().get(key)?.to_str().ok();
    if let Some(url) = text(proto::REDIRECT_METADATA) {
        let scheme = url
            .parse::<tonic::codegen::http::Uri>()
            .ok()
            .filter(|uri| uri.host().is_some())
            .and_then(|uri| uri.scheme_str().map(str::to_owned));
        let refused = |why| Advice::Refused {
            url: url.to_owned(),
            why,
        };
        return match (scheme.as_deref(), tls) {
            (Some("https"), true) | (Some("http"), false) => Advice::GoTo(url.to_owned()),
            (Some(_), true) => refused("TLS is configured and the redirect is not https"),
            (Some(_), false) => refused("the configured link is plaintext (http)"),
            (None, _) => refused("not a URL"),
        };
    }
    match text(proto::RETRY_AFTER_METADATA).and_then(|ms| ms.parse::<u64>().ok()) {
        // At most the backoff's own bound.
        Some(ms) => Advice::RetryAfter(Duration::from_millis(ms.min(15_000))),
        None => Advice::Backoff,
    }
}

/// Redirects followed in a row and the replica that could not be reached.
#[derive(Debug, Default)]
pub(super) struct Redirects {
    /// Followed in a row: a loop of stale ones backs off after 3.
    followed: u32,
    /// A replica sent to that could not be connected to: it may have
    /// died, and the others name it until its Leases run out.
    unreachable: Option<String>,
}

impl Redirects {
    /// What to do after an attempt at `target` (a redirect's URL, or
    /// `None` for the configured endpoint) that ended with `error` (`None`:
    /// the cloud closed the stream), with `tls` configured. `opened` says
    /// the stream got open, which clears what was remembered.
    pub(super) fn after(
        &mut self,
        target: Option<String>,
        opened: bool,
        error: Option<&SyncError>,
        tls: bool,
    ) -> Advice {
        if opened {
            self.unreachable = None;
        } else if target.is_some() && matches!(error, Some(SyncError::Connect { .. })) {
            // Only a replica that could not be reached; one that answered
            // with a refusal of its own is alive and may be named again.
            self.unreachable = target;
        }
        let advice = error.map_or(Advice::Backoff, |e| advice_of(e, tls));
        match advice {
            // Sent again to the replica that could not be reached: its
            // shards are about to move; ask again soon.
            Advice::GoTo(url) if self.unreachable.as_ref() == Some(&url) => {
                self.followed = 0;
                Advice::RetryAfter(Duration::from_secs(1))
            }
            Advice::GoTo(url) if self.followed < 3 => {
                self.followed += 1;
                Advice::GoTo(url)
            }
            Advice::GoTo(_) => {
                self.followed = 0;
                Advice::Backoff
            }
            advice => {
                self.followed = 0;
                advice
            }
        }
    }
}

/// `settings` aimed at `url`, a replica's own address: its certificate is
/// still checked against the name of the configured endpoint.
pub(super) fn redirected(settings: &SyncSettings, url: String) -> SyncSettings {
    let mut here = settings.clone();
    if let Some(tls) = &mut here.tls
        && tls.server_name.is_none()
    {
        tls.server_name = settings
            .cloud
            .parse::<tonic::codegen::http::Uri>()
            .ok()
            .and_then(|uri| uri.host().map(|h| h.trim_matches(['[', ']']).to_owned()));
    }
    here.cloud = url;
    here
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::tests::settings;

    fn refusal(code: tonic::Code, metadata: &[(&'static str, &str)]) -> SyncError {
        let mut status = tonic::Status::new(code, "served elsewhere");
        for (key, value) in metadata {
            status.metadata_mut().insert(*key, value.parse().unwrap());
        }
        SyncError::Stream(status)
    }

    #[test]
    fn only_an_unavailable_refusal_that_says_where_or_when_is_followed() {
        let to = "https://10.0.0.7:7443";
        let unavailable = tonic::Code::Unavailable;
        let go = [(proto::REDIRECT_METADATA, to)];
        assert_eq!(
            advice_of(&refusal(unavailable, &go), true),
            Advice::GoTo(to.into())
        );
        assert_eq!(advice_of(&refusal(unavailable, &[]), true), Advice::Backoff);
        let denied = tonic::Code::PermissionDenied;
        assert_eq!(advice_of(&refusal(denied, &go), true), Advice::Backoff);
        let garbled = [(proto::REDIRECT_METADATA, "not a url")];
        assert!(matches!(
            advice_of(&refusal(unavailable, &garbled), true),
            Advice::Refused { .. }
        ));
        let soon = [(proto::RETRY_AFTER_METADATA, "1000")];
        assert_eq!(
            advice_of(&refusal(unavailable, &soon), true),
            Advice::RetryAfter(Duration::from_secs(1))
        );
        let late = [(proto::RETRY_AFTER_METADATA, "999999999")];
        assert_eq!(
            advice_of(&refusal(unavailable, &late), true),
            Advice::RetryAfter(Duration::from_secs(15))
        );
        assert_eq!(advice_of(&SyncError::Closed, true), Advice::Backoff);
    }

    #[test]
    fn with_tls_configured_a_redirect_to_plaintext_is_not_followed() {
        let unavailable = tonic::Code::Unavailable;
        for url in ["http://10.0.0.7:80", "HTTP://10.0.0.7", "ftp://10.0.0.7"] {
            let to_plain = refusal(unavailable, &[(proto::REDIRECT_METADATA, url)]);
            assert!(
                matches!(advice_of(&to_plain, true), Advice::Refused { .. }),
                "{url}"
            );
        }
        // A plaintext link (a lab's --insecure-plaintext) is not upgraded
        // behind the operator's back either: it follows http only.
        let to_tls = refusal(
            unavailable,
            &[(proto::REDIRECT_METADATA, "https://10.0.0.7:7443")],
        );
        assert!(matches!(advice_of(&to_tls, false), Advice::Refused { .. }));
        let to_plain = refusal(
            unavailable,
            &[(proto::REDIRECT_METADATA, "http://10.0.0.7:7443")],
        );
        assert_eq!(
            advice_of(&to_plain, false),
            Advice::GoTo("http://10.0.0.7:7443".into())
        );
    }

    #[test]
    fn a_replica_that_answered_is_not_remembered_as_unreachable() {
        let b = "https://10.0.0.8:7443";
        let go_b = || refusal(tonic::Code::Unavailable, &[(proto::REDIRECT_METADATA, b)]);
        let mut redirects = Redirects::default();
        assert_eq!(
            redirects.after(None, false, Some(&go_b()), true),
            Advice::GoTo(b.into())
        );
        // B answers, with a refusal of its own (its shard is moving).
        let moving = refusal(
            tonic::Code::Unavailable,
            &[(proto::RETRY_AFTER_METADATA, "1000")],
        );
        assert_eq!(
            redirects.after(Some(b.into()), false, Some(&moving), true),
            Advice::RetryAfter(Duration::from_secs(1))
        );
        // The next redirect to B is followed.
        assert_eq!(
            redirects.after(None, false, Some(&go_b()), true),
            Advice::GoTo(b.into())
        );
        // B cannot be reached: the Service sending there again is asked
        // again soon instead.
        let unreachable = SyncError::Connect {
            endpoint: b.into(),
            // (Any transport error stands for the refused connection.)
            source: tonic::transport::Endpoint::from_shared("not a uri".to_owned()).unwrap_err(),
        };
        assert_eq!(
            redirects.after(Some(b.into()), false, Some(&unreachable), true),
            Advice::Backoff
        );
        assert_eq!(
            redirects.after(None, false, Some(&go_b()), true),
            Advice::RetryAfter(Duration::from_secs(1))
        );
        // Once a session opened, B is forgotten.
        assert_eq!(
            redirects.after(None, true, Some(&go_b()), true),
            Advice::GoTo(b.into())
        );
    }

    #[test]
    fn a_loop_of_redirects_backs_off_after_three() {
        let mut redirects = Redirects::default();
        let go = refusal(
            tonic::Code::Unavailable,
            &[(proto::REDIRECT_METADATA, "https://10.0.0.9:7443")],
        );
        for _ in 0..3 {
            assert!(matches!(
                redirects.after(None, false, Some(&go), true),
                Advice::GoTo(_)
            ));
        }
        assert_eq!(
            redirects.after(None, false, Some(&go), true),
            Advice::Backoff
        );
        assert!(matches!(
            redirects.after(None, false, Some(&go), true),
            Advice::GoTo(_)
        ));
    }

    #[test]
    fn a_redirected_session_checks_the_certificate_against_the_configured_name() {
        let base = settings("https://edgefleet-cloud.edgefleet-system.svc:7443");
        let here = redirected(&base, "https://10.0.0.7:7443".into());
        assert_eq!(here.cloud, "https://10.0.0.7:7443");
        let name = here.tls.as_ref().and_then(|t| t.server_name.as_deref());
        assert_eq!(name, Some("edgefleet-cloud.edgefleet-system.svc"));
        // A name given explicitly stays.
        let mut named = base.clone();
        named.tls.as_mut().unwrap().server_name = Some("sync.example".into());
        let here = redirected(&named, "https://10.0.0.7:7443".into());
        let name = here.tls.as_ref().and_then(|t| t.server_name.as_deref());
        assert_eq!(name, Some("sync.example"));
    }
}
