//! What a CoAP request must be before it is handled, without I/O: the
//! options it may carry (RFC 7252 §5.4.1), the formats of its payload and
//! of the response it accepts (§5.10.3, §5.10.4), and how much a refusal
//! may say (§11.3: a response to a request nobody authenticated is no
//! larger than a small multiple of the request, so the agent is no
//! amplifier for a spoofed source address).

use coap_lite::option_value::OptionValueU16;
use coap_lite::{CoapOption, Packet, ResponseType};

/// `application/cbor`: the only format the agent reads and writes.
pub const CBOR: u16 = 60;

/// The critical options (odd numbers) the agent understands: where the
/// request is addressed (Uri-Host, Uri-Port, Uri-Path, Uri-Query: no
/// resource takes a query, and one is ignored) and Accept. Any other
/// critical option — conditional requests, block-wise transfer, proxying,
/// OSCORE — changes what the request means in a way the agent does not
/// implement, so the request is refused with `4.02`. Unknown elective
/// options are ignored, as the RFC says.
const UNDERSTOOD_CRITICAL: [u16; 5] = [3, 7, 11, 15, 17];

/// Why a request is refused before it is handled.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// The counter's label.
    pub outcome: &'static str,
    /// The response code.
    pub code: ResponseType,
    /// A short diagnostic.
    pub text: String,
}

/// The first critical option in `request` the agent does not understand.
pub fn unrecognized_critical(request: &Packet) -> Option<u16> {
    request
        .options()
        .map(|(number, _)| *number)
        .find(|n| n % 2 == 1 && !UNDERSTOOD_CRITICAL.contains(n))
}

/// The number in a request's first `option`, if it has one; `Err` for a
/// value that is not a number of at most two bytes.
fn format_option(request: &Packet, option: CoapOption) -> Option<Result<u16, ()>> {
    let value = request.get_first_option_as::<OptionValueU16>(option)?;
    Some(value.map(|v| v.0).map_err(|_| ()))
}

/// Checks a request before it is handled: its critical options, the
/// Content-Format of its payload if `reads_payload`, and its Accept if
/// `answers_with_payload`. A payload without Content-Format is taken as
/// CBOR (devices that cannot spare the option may leave it out).
pub fn check(
    request: &Packet,
    reads_payload: bool,
    answers_with_payload: bool,
) -> Result<(), Refusal> {
    if let Some(number) = unrecognized_critical(request) {
        return Err(Refusal {
            outcome: "bad_option",
            code: ResponseType::BadOption,
            text: format!("option {number} not supported"),
        });
    }
    if reads_payload {
        match format_option(request, CoapOption::ContentFormat) {
            None | Some(Ok(CBOR)) => {}
            Some(_) => {
                return Err(Refusal {
                    outcome: "unsupported_content_format",
                    code: ResponseType::UnsupportedContentFormat,
                    text: "send application/cbor (60)".into(),
                });
            }
        }
    }
    if answers_with_payload {
        match format_option(request, CoapOption::Accept) {
            None | Some(Ok(CBOR)) => {}
            Some(_) => {
                return Err(Refusal {
                    outcome: "not_acceptable",
                    code: ResponseType::NotAcceptable,
                    text: "only application/cbor (60)".into(),
                });
            }
        }
    }
    Ok(())
}

/// `text` cut (at a character boundary) to at most `budget` bytes: a
/// refusal's diagnostic is no longer than the request it answers, so the
/// whole response stays within about twice the request.
pub fn short(mut text: String, budget: usize) -> String {
    if text.len() > budget {
        let mut end = budget;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use coap_lite::{MessageClass, RequestType};

    fn post() -> Packet {
        let mut p = Packet::new();
        p.header.code = MessageClass::Request(RequestType::Post);
        p.add_option(CoapOption::UriPath, b"d".to_vec());
        p
    }

    #[test]
    fn unknown_critical_options_are_refused_and_elective_ones_ignored() {
        let mut p = post();
        p.add_option(CoapOption::UriHost, b"agent".to_vec());
        p.add_option(CoapOption::UriQuery, b"x=1".to_vec());
        p.add_option(CoapOption::Unknown(2000), vec![1]); // elective
        p.add_option(CoapOption::NoResponse, vec![2]); // elective
        assert_eq!(check(&p, true, true), Ok(()));
        for critical in [
            CoapOption::IfMatch,
            CoapOption::IfNoneMatch,
            CoapOption::Block1,
            CoapOption::Block2,
            CoapOption::ProxyUri,
            CoapOption::Oscore,
            CoapOption::Unknown(2001),
        ] {
            let mut p = post();
            p.add_option(critical, vec![0]);
            let refusal = check(&p, true, true).unwrap_err();
            assert_eq!(refusal.code, ResponseType::BadOption, "{critical:?}");
            assert_eq!(refusal.outcome, "bad_option");
        }
    }

    #[test]
    fn only_cbor_is_read_and_only_cbor_is_offered() {
        let with = |option: CoapOption, value: u16| {
            let mut p = post();
            p.add_option(option, value.to_be_bytes().to_vec());
            p
        };
        assert_eq!(check(&post(), true, true), Ok(()), "no format: CBOR");
        assert_eq!(
            check(&with(CoapOption::ContentFormat, 60), true, true),
            Ok(())
        );
        let text = with(CoapOption::ContentFormat, 0);
        assert_eq!(
            check(&text, true, true).unwrap_err().code,
            ResponseType::UnsupportedContentFormat
        );
        // A GET carries no payload: its Content-Format is not looked at.
        assert_eq!(check(&text, false, true), Ok(()));
        let json = with(CoapOption::Accept, 50);
        assert_eq!(
            check(&json, true, true).unwrap_err().code,
            ResponseType::NotAcceptable
        );
        assert_eq!(check(&json, true, false), Ok(()), "2.04 has no payload");
        assert_eq!(check(&with(CoapOption::Accept, 60), false, true), Ok(()));
        // A value too long to be a format is not one.
        let mut odd = post();
        odd.add_option(CoapOption::ContentFormat, vec![0, 0, 60]);
        assert!(check(&odd, true, true).is_err());
    }

    #[test]
    fn diagnostics_are_cut_to_the_budget() {
        assert_eq!(short("abcdef".into(), 4), "abcd");
        assert_eq!(short("abc".into(), 4), "abc");
        assert_eq!(short("äö".into(), 3), "ä", "at a character boundary");
        assert_eq!(short("abc".into(), 0), "");
    }
}
