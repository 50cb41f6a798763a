//! Who calls the gateway: an identity (the token's name, with auth on) and an address. A
//! leaf type that auth, rate limiting, audit and the workspaces all name.

use std::net::IpAddr;

/// Who asked: the token's name when auth is on, and the client address when known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Caller {
    pub identity: Option<String>,
    pub addr: Option<IpAddr>,
    /// Set for callers that are not network clients (`mcp-run stdio`).
    pub local: Option<&'static str>,
}

impl Caller {
    /// A caller that is not a network client, such as the stdio MCP server.
    pub(crate) fn local(name: &'static str) -> Self {
        Self {
            local: Some(name),
            ..Self::default()
        }
    }

    /// The rate-limit key: the identity, else the address, else the local name.
    pub(crate) fn key(&self) -> String {
        match (&self.identity, &self.addr, self.local) {
            (Some(id), _, _) => format!("id:{id}"),
            (None, Some(addr), _) => format!("ip:{addr}"),
            (None, None, Some(l)) => format!("local:{l}"),
            (None, None, None) => "unknown".to_owned(),
        }
    }

    /// How the audit log names the caller.
    pub(crate) fn describe(&self) -> String {
        match (&self.identity, &self.addr, self.local) {
            (Some(id), Some(a), _) => format!("{id}@{a}"),
            (Some(id), None, _) => id.clone(),
            (None, Some(a), _) => a.to_string(),
            (None, None, Some(l)) => l.to_owned(),
            (None, None, None) => "unknown".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caller_keys() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let c = Caller {
            identity: Some("ci".into()),
            addr: Some(ip),
            local: None,
        };
        assert_eq!(c.key(), "id:ci");
        assert_eq!(c.describe(), "ci@10.0.0.1");
        let anon = Caller {
            addr: Some(ip),
            ..Default::default()
        };
        assert_eq!(anon.key(), "ip:10.0.0.1");
        assert_eq!(Caller::local("stdio").key(), "local:stdio");
    }
}
