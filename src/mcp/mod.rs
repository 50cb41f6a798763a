//! The MCP server: tool `run_network_tool`, the operator's declared CLI tools
//! ([`tools`]), the resource `mcp-run://capabilities` and the kept outputs of runs
//! (`mcp-run://runs/{id}/{stream}`, [`resources`]), over streamable HTTP at `/mcp` (nested
//! in the gateway's router) and over stdio (`mcp-run stdio`).
//!
//! Every call goes through [`execute::execute`] and so through [`Runner::start_with`], the
//! same entry point as `/raw`, so limits, timeouts and backends behave the same; every
//! result is shaped by [`reply`] within the call's character budget.

pub(crate) mod config;
pub(crate) mod execute;
mod forward;
pub(crate) mod reply;
pub(crate) mod resources;
pub(crate) mod schema;
pub(crate) mod store;
pub(crate) mod tools;

use std::sync::Arc;
use std::time::Duration;

use rmcp::ErrorData as McpError;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ListResourceTemplatesResult,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, Resource, ResourceContents, ResourceTemplate,
    ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler};
use serde_json::{Map, Value};

use crate::capabilities::{Capabilities, EXPERIMENTAL_KEY, RESOURCE_URI};
use crate::contract::{ErrorBody, ErrorCode, RunRequest};
use crate::result::StructuredResult;
use crate::runner::Runner;
use crate::templates::{AUTO, RAW};

pub(crate) use config::McpConfig;
use execute::{Call, Stopped, execute};
pub(crate) use forward::{
    ConnectionClosed, LIST_PATH as LIST_OUTPUTS_PATH, READ_PATH as READ_OUTPUT_PATH,
    answer as answer_peer_read, answer_list as answer_peer_list,
};
use reply::error_result;
use store::{Missing, OutputStore, StoreLimits};

/// The one built-in tool.
pub(crate) const TOOL: &str = "run_network_tool";
/// How many of the caller's kept runs `resources/list` names (the most recent, of every
/// replica).
pub(crate) const LISTED_RUNS: usize = 20;

/// The tool that ends one of the caller's sessions (served when sessions are on).
pub(crate) const END_SESSION_TOOL: &str = "end_session";

/// The resource listing the caller's open sessions.
pub(crate) const SESSIONS_URI: &str = "mcp-run://sessions";

/// What the `session` argument says to an agent.
const SESSION_HELP: &str = "Run in the runner of this named session instead of a fresh one: what earlier calls wrote stays (target/, node_modules/, .venv/, caches, /tmp), so rebuilds are incremental. For an edit-build-test loop pass the same name (e.g. \"build\") on every call; the first call opens the session. Calls of one session run one at a time. It ends after it was idle for its TTL, or with the tool `end_session`; `mcp-run://sessions` lists yours. Omit it for a run that must start clean.";

/// The tool's output schema: derived once, not on every tools/list and tools/call.
static OUTPUT_SCHEMA: std::sync::LazyLock<Map<String, Value>> =
    std::sync::LazyLock::new(schema::run_output);

/// What an MCP session needs; cheap to clone (one per session, all sharing one store).
#[derive(Clone)]
pub(crate) struct McpService {
    runner: Arc<Runner>,
    capabilities: Arc<Capabilities>,
    config: Arc<McpConfig>,
    /// Full outputs of runs; `None` when the directory could not be made (results say so).
    store: Option<Arc<OutputStore>>,
    /// Operator-declared CLI tools (config `tools:`).
    tools: Arc<Vec<tools::ToolConfig>>,
    /// Output templates: the built-ins plus the nearest `.mcp-run/config.yaml` at or above
    /// `template_dir`, reloaded after a TTL.
    templates: Arc<crate::templates::TemplateStore>,
    template_dir: std::path::PathBuf,
    /// The session of calls that name none (`mcp-run stdio --session NAME`).
    default_session: Option<String>,
    /// The other replicas of this gateway: kept outputs of theirs are read through them.
    peers: Option<Arc<crate::peers::Peers>>,
}

impl McpService {
    pub(crate) fn new(
        runner: Arc<Runner>,
        capabilities: Arc<Capabilities>,
        config: &McpConfig,
    ) -> Self {
        let limits = StoreLimits {
            max_bytes: config.output_store.max_bytes,
            max_age: Duration::from_secs(config.output_store.max_age_secs),
            max_stream_bytes: config.max_output_bytes as u64,
        };
        let store = match OutputStore::new(config.output_store.dir.as_deref(), limits) {
            Ok(s) => Some(Arc::new(s)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot make a directory for MCP outputs: results will not name the full output");
                None
            }
        };
        Self {
            runner,
            capabilities,
            config: Arc::new(config.clone()),
            store,
            tools: Arc::new(Vec::new()),
            templates: Arc::new(crate::templates::TemplateStore::default()),
            template_dir: std::env::current_dir().unwrap_or_else(|_| "/".into()),
            default_session: None,
            peers: None,
        }
    }

    /// Tags this replica's run ids and forwards reads of other replicas' runs to them
    /// (`forward`). Call it right after [`McpService::new`].
    pub(crate) fn with_peers(mut self, peers: Option<Arc<crate::peers::Peers>>) -> Self {
        if let Some(p) = &peers
            && let Some(store) = self.store.as_mut().and_then(Arc::get_mut)
        {
            store.set_tag(p.tag());
        }
        self.peers = peers;
        self
    }

    /// Runs every call that names no session in the session `name` (`mcp-run stdio
    /// --session NAME`: one runner for the client's lifetime).
    pub(crate) fn with_default_session(mut self, name: Option<String>) -> Self {
        self.default_session = name;
        self
    }

    /// Whether calls may name a session (kept here, or by the remote gateway).
    fn sessions_on(&self) -> bool {
        self.runner.sessions().is_some() || self.runner.executor().forwards_sessions()
    }

    /// The tool `end_session`.
    fn end_session_tool(&self) -> Tool {
        let input = serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": crate::contract::MAX_SESSION_NAME,
                "description": "The session to end (the `session` you passed to run_network_tool)."}},
            "required": ["name"],
            "additionalProperties": false
        });
        let mut tool = Tool::new(
            END_SESSION_TOOL,
            "End one of your sessions of run_network_tool: its running call is killed and its runner (directory or pod, with everything calls wrote) is deleted. Do it when your build loop is done; idle sessions also end by themselves after their TTL.",
            as_object(input),
        );
        tool.annotations = Some(
            ToolAnnotations::with_title("End an mcp-run session")
                .read_only(false)
                .destructive(true)
                .idempotent(true)
                .open_world(false),
        );
        tool
    }

    async fn end_session(
        &self,
        arguments: Option<Map<String, Value>>,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResult {
        let caller = crate::auth::mcp_caller(&context.extensions)
            .unwrap_or_else(|| crate::auth::Caller::local("stdio"));
        let name = arguments
            .as_ref()
            .and_then(|a| a.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if let Err(e) = crate::contract::check_session_name(&name) {
            return error_result(&e);
        }
        // With peers, the session lives on the caller's home replica.
        if let Some(ended) = forward::end_session_at_home(self, &caller, &name).await {
            return match ended {
                Ok(()) => CallToolResult::success(vec![rmcp::model::ContentBlock::text(format!(
                    "session {name:?} ended"
                ))]),
                Err(e) => error_result(&e),
            };
        }
        let Some(sessions) = self.runner.sessions() else {
            return error_result(&ErrorBody::new(
                ErrorCode::InvalidRequest,
                "this server keeps no sessions itself (sessions are off, or its backend keeps them: end them there)",
            ));
        };
        match sessions
            .end(self.runner.executor().as_ref(), &caller, &name)
            .await
        {
            Ok(()) => CallToolResult::success(vec![rmcp::model::ContentBlock::text(format!(
                "session {name:?} ended"
            ))]),
            Err(e) => error_result(&e),
        }
    }

    /// The caller's open sessions as JSON.
    async fn sessions_json(
        &self,
        context: &RequestContext<RoleServer>,
    ) -> Result<String, McpError> {
        let caller = crate::auth::mcp_caller(&context.extensions)
            .unwrap_or_else(|| crate::auth::Caller::local("stdio"));
        // With peers, the sessions live on the caller's home replica.
        match forward::sessions_at_home(self, &caller).await {
            Some(Ok(list)) => return Ok(serde_json::to_string_pretty(&list).unwrap_or_default()),
            Some(Err(e)) => return Err(McpError::internal_error(e.message, None)),
            None => {}
        }
        let sessions = match self.runner.sessions() {
            Some(s) => s
                .list(self.runner.executor().as_ref(), &caller)
                .await
                .map_err(|e| McpError::internal_error(e.message, None))?,
            None => Vec::new(),
        };
        let list = crate::contract::SessionList { sessions };
        Ok(serde_json::to_string_pretty(&list).unwrap_or_default())
    }

    /// Takes output templates from this store, configured for this directory (the
    /// process's current directory by default).
    pub(crate) fn with_templates(
        mut self,
        store: Arc<crate::templates::TemplateStore>,
        dir: std::path::PathBuf,
    ) -> Self {
        self.templates = store;
        self.template_dir = dir;
        self
    }

    /// Serves these operator-declared CLI tools too, each as its own MCP tool.
    pub(crate) fn with_tools(mut self, tools: Arc<Vec<tools::ToolConfig>>) -> Self {
        self.tools = tools;
        self
    }

    /// The MCP definition of a declared CLI tool.
    fn cli_tool(&self, t: &tools::ToolConfig) -> Tool {
        let mut description = format!("{} Runs `{}`", t.description.trim_end(), t.usage());
        if let Some(a) = &t.args {
            description.push_str(&format!("; positional arguments: {}", a.description));
        }
        description.push_str(&format!(
            ". {} Result: {{stdout, stderr, exitCode}}.",
            self.capabilities.where_line()
        ));
        let mut tool = Tool::new(t.name.clone(), description, t.input_schema());
        tool.output_schema = Some(Arc::new(tools::output_schema()));
        tool.annotations = Some(annotations(&t.name));
        tool
    }

    /// Runs a declared CLI tool: an input or start failure is an execution error (`isError`,
    /// the reason, no output); a command that ran gives `{stdout, stderr, exitCode}`, with
    /// `isError` when the exit code is not 0 (a command error).
    async fn run_cli_tool(
        &self,
        t: &tools::ToolConfig,
        arguments: Option<Map<String, Value>>,
        context: RequestContext<RoleServer>,
    ) -> CallToolResult {
        // The template is resolved first: an unknown name runs nothing.
        let template = match &t.template {
            None => None,
            Some(name) => {
                match self.template(name, &format!("tool {} names the unknown template", t.name)) {
                    Ok(tpl) => Some(tpl),
                    Err(e) => return error_result(&e),
                }
            }
        };
        let req = match t.request(&arguments.unwrap_or_default()) {
            Ok(mut r) => {
                r.session = self.default_session.clone();
                r
            }
            Err(e) => {
                return error_result(&ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("invalid input for {}: {e}", t.name),
                ));
            }
        };
        let call = Call {
            template,
            stdin: None,
            capture_bytes: capture_bytes(self.config.result_chars),
        };
        match execute(&self.runner, self.store.as_deref(), req, call, &context).await {
            Ok(ran) => reply::cli_result(&ran, self.config.result_chars),
            Err(stopped) => error_result(&stopped.error()),
        }
    }

    /// The tool's definition: the input schema derived from [`RunRequest`] with the
    /// server's bounds, the StructuredResult schema as output schema, annotations saying
    /// what it does.
    pub(crate) fn tool(&self) -> Tool {
        let caps = &self.capabilities;
        let catalog = self.templates.catalog(&self.template_dir);
        let mut listing: Vec<String> = catalog
            .entries()
            .map(|(t, _)| format!("`{}`: {}", t.name, t.description))
            .collect();
        listing.push(format!("`{RAW}`: the output as it came"));
        let mut names = catalog.names();
        names.push(RAW.into());
        let input = schema::run_input(&schema::InputExtras {
            profiles: caps
                .backend
                .profiles
                .iter()
                .map(|p| p.name.clone())
                .collect(),
            default_timeout_secs: caps.limits.default_timeout_secs,
            max_timeout_secs: caps.limits.max_timeout_secs,
            templates: names,
            template_listing: listing.join("; "),
            default_result_chars: self.config.result_chars,
            max_result_chars: self.config.max_result_chars,
            max_stdin_bytes: self.config.max_stdin_bytes,
        });
        // Workspaces (docs/workspaces.md) only when this gateway takes them.
        let mut input = input;
        if self.runner.workspaces().is_none()
            && let Some(props) = input.get_mut("properties").and_then(Value::as_object_mut)
        {
            props.remove("workspace");
            props.remove("sync_back");
        }
        if self.sessions_on() {
            input["properties"]["session"] = serde_json::json!({
                "type": "string", "minLength": 1, "maxLength": crate::contract::MAX_SESSION_NAME,
                "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$",
                "description": SESSION_HELP
            });
        } else if let Some(p) = input.get_mut("properties").and_then(Value::as_object_mut) {
            p.remove("session");
            p.remove("session_busy");
        }
        let session_hint = if self.sessions_on() {
            " For a build or test loop, pass the same `session` name on every call: the runner and its build outputs stay warm between calls."
        } else {
            ""
        };
        let description = format!(
            "Run a command and get its stdout, stderr and exit code.{session_hint} {} Limits: timeout up to {} s (default {} s); no TTY; the result carries up to {} characters of output (head and tail kept, each cut marked), and the full output stays readable as a resource (mcp-run://runs/{{id}}/stdout, with ?lines=, ?bytes= or ?grep=) for {} s.",
            caps.where_line(),
            caps.limits.max_timeout_secs,
            caps.limits.default_timeout_secs,
            self.config.result_chars,
            self.config.output_store.max_age_secs,
        );
        let mut tool = Tool::new(TOOL, description, input);
        tool.output_schema = Some(Arc::new(OUTPUT_SCHEMA.clone()));
        tool.annotations = Some(annotations("Run a command on mcp-run"));
        tool
    }

    /// The template `name`, or an error that starts with `unknown` and lists what there is.
    fn template(&self, name: &str, unknown: &str) -> Result<crate::templates::Template, ErrorBody> {
        self.templates.get(name, &self.template_dir).ok_or_else(|| {
            ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!(
                    "{unknown} {name:?}; available: {}",
                    self.templates.names(&self.template_dir).join(", ")
                ),
            )
        })
    }

    /// MCP's own arguments of `run_network_tool`, taken out of `arguments` (what is left is
    /// the run request): the call and its budget.
    fn call_arguments(
        &self,
        arguments: &mut Map<String, Value>,
    ) -> Result<(Call, usize), ErrorBody> {
        let invalid = |m: String| {
            ErrorBody::new(ErrorCode::InvalidRequest, format!("invalid arguments: {m}"))
        };
        // No template named: `auto` (docs/templates.md); `raw` asks for none.
        let template = match arguments.remove("template") {
            None | Some(Value::Null) => Some(self.template(AUTO, "unknown template")?),
            Some(Value::String(name)) if name == RAW => None,
            Some(Value::String(name)) => Some(self.template(&name, "unknown template")?),
            Some(other) => return Err(invalid(format!("template must be a string, not {other}"))),
        };
        let stdin = match arguments.remove("stdin") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.len() <= self.config.max_stdin_bytes => Some(s),
            Some(Value::String(s)) => {
                return Err(invalid(format!(
                    "stdin is {} bytes, more than the {} this server accepts (mcp.max_stdin_bytes)",
                    s.len(),
                    self.config.max_stdin_bytes
                )));
            }
            Some(other) => return Err(invalid(format!("stdin must be a string, not {other}"))),
        };
        let budget = match arguments.remove("result_chars") {
            None | Some(Value::Null) => self.config.result_chars,
            Some(v) => match v.as_u64() {
                Some(n) if (1000..=self.config.max_result_chars as u64).contains(&n) => n as usize,
                _ => {
                    return Err(invalid(format!(
                        "result_chars must be an integer from 1000 to {}, not {v}",
                        self.config.max_result_chars
                    )));
                }
            },
        };
        let call = Call {
            template,
            stdin,
            capture_bytes: capture_bytes(budget),
        };
        Ok((call, budget))
    }

    async fn run(
        &self,
        arguments: Option<Map<String, Value>>,
        context: RequestContext<RoleServer>,
    ) -> CallToolResult {
        let mut arguments = arguments.unwrap_or_default();
        // Resolved before anything runs: a bad template or budget runs nothing.
        let (call, budget) = match self.call_arguments(&mut arguments) {
            Ok(c) => c,
            Err(e) => return error_result(&e),
        };
        if let Some(unknown) = self.unknown_argument(&arguments) {
            return error_result(&ErrorBody::new(ErrorCode::InvalidRequest, unknown));
        }
        let req: RunRequest = match serde_json::from_value::<RunRequest>(Value::Object(arguments)) {
            Ok(mut r) => {
                if r.session.is_none() {
                    r.session = self.default_session.clone();
                }
                r
            }
            Err(e) => {
                return error_result(&ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("invalid arguments: {e}"),
                ));
            }
        };
        let shown = self.runner.redact_request(&req);
        match execute(&self.runner, self.store.as_deref(), req, call, &context).await {
            Ok(ran) => reply::run_result(TOOL, &shown, &ran, budget),
            Err(Stopped::NotStarted(e)) => {
                reply::finish(StructuredResult::not_started(TOOL, &shown, &e))
            }
            Err(stopped) => error_result(&stopped.error()),
        }
    }

    /// An argument the tool's input schema does not have, named with every argument it
    /// has (serde's own message would list only the `/raw` fields, not MCP's).
    fn unknown_argument(&self, arguments: &Map<String, Value>) -> Option<String> {
        let tool = self.tool();
        let known = tool.input_schema.get("properties")?.as_object()?;
        let unknown = arguments.keys().find(|k| !known.contains_key(k.as_str()))?;
        // A client's text, shown back: bounded.
        let unknown: String = unknown.chars().take(64).collect();
        let mut names: Vec<&str> = known.keys().map(String::as_str).collect();
        names.sort_unstable();
        Some(format!(
            "invalid arguments: unknown argument {:?}; the arguments are {}",
            unknown,
            names.join(", ")
        ))
    }

    fn capabilities_json(&self) -> Value {
        serde_json::to_value(self.capabilities.as_ref()).unwrap_or_default()
    }

    /// An error result with configured secrets redacted: its text may quote the caller's
    /// arguments (serde's "invalid type: string ..."), which /raw redacts too.
    fn redact_error(&self, mut r: CallToolResult) -> CallToolResult {
        if let (Some(red), Some(true)) = (self.runner.redactor(), r.is_error) {
            for c in &mut r.content {
                if let rmcp::model::ContentBlock::Text(t) = c {
                    t.text = red.redact_str(&t.text);
                }
            }
        }
        r
    }

    /// A protocol error with configured secrets redacted from its message.
    fn redact_mcp_error(&self, mut e: McpError) -> McpError {
        if let Some(red) = self.runner.redactor() {
            e.message = red.redact_str(&e.message).into();
        }
        e
    }

    /// `resources/read` of a kept output: here, or on the replica that keeps it.
    async fn read_output(
        &self,
        uri: &str,
        context: &RequestContext<RoleServer>,
    ) -> Result<ReadResourceResult, McpError> {
        let parsed = resources::OutputUri::parse(uri)
            .map_err(|e| McpError::invalid_params(e.to_string(), None))?;
        let caller = crate::auth::mcp_caller(&context.extensions)
            .unwrap_or_else(|| crate::auth::Caller::local("stdio"));
        if let Some(peers) = &self.peers
            && let Some(replica) = store::replica_of(&parsed.id)
            && replica != peers.tag()
        {
            return forward::read_output(peers, replica, &parsed.id, uri, &caller).await;
        }
        self.read_output_as(uri, &caller)
    }

    /// `caller`'s most recent finished runs kept by this replica, at most `max`.
    pub(crate) fn kept_runs(
        &self,
        caller: &crate::auth::Caller,
        max: usize,
    ) -> Vec<forward::KeptRun> {
        let Some(store) = &self.store else {
            return Vec::new();
        };
        store
            .list(caller, max)
            .into_iter()
            .map(|run| forward::KeptRun {
                id: run.id.clone(),
                age_ms: run.age().as_millis() as u64,
                kept: [
                    run.kept(crate::result::Stream::Stdout),
                    run.kept(crate::result::Stream::Stderr),
                ],
            })
            .collect()
    }

    /// `resources/read` of a kept output of this replica, as `caller` (also what a peer asks
    /// for its caller).
    pub(crate) fn read_output_as(
        &self,
        uri: &str,
        caller: &crate::auth::Caller,
    ) -> Result<ReadResourceResult, McpError> {
        let parsed = resources::OutputUri::parse(uri)
            .map_err(|e| McpError::invalid_params(e.to_string(), None))?;
        let Some(store) = &self.store else {
            return Err(McpError::resource_not_found(
                "this server keeps no outputs (its output directory could not be made)",
                None,
            ));
        };
        let run = store.get(&parsed.id, caller).map_err(|m| {
            let limits = store.limits();
            let message = match m {
                Missing::Expired => format!(
                    "run {} has expired: outputs are kept for {} s and {} bytes in all; run the command again",
                    parsed.id,
                    limits.max_age.as_secs(),
                    limits.max_bytes
                ),
                Missing::Unknown => format!("no run {} on this server", parsed.id),
            };
            McpError::resource_not_found(message, None)
        })?;
        let page = resources::read(&run, &parsed, self.config.result_chars)
            .map_err(|e| McpError::invalid_params(e.to_string(), None))?;
        let contents = match page.blob {
            None => vec![ResourceContents::text(page.text, uri)],
            Some(bytes) => {
                let blob = base64_simd::STANDARD.encode_to_string(&bytes);
                let mut c = vec![
                    ResourceContents::blob(blob, uri).with_mime_type("application/octet-stream"),
                ];
                if !page.text.is_empty() {
                    c.push(ResourceContents::text(page.text, uri));
                }
                c
            }
        };
        Ok(ReadResourceResult::new(contents))
    }
}

/// Bytes held in memory per stream for a budget of `chars` characters (at most four bytes
/// each).
fn capture_bytes(chars: usize) -> usize {
    chars.saturating_mul(4).max(4096)
}

fn annotations(title: &str) -> ToolAnnotations {
    ToolAnnotations::with_title(title)
        .read_only(false)
        .destructive(true)
        .idempotent(false)
        .open_world(true)
}

fn as_object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

impl ServerHandler for McpService {
    fn get_info(&self) -> ServerConfig {
        let mut experimental = std::collections::BTreeMap::new();
        experimental.insert(
            EXPERIMENTAL_KEY.to_string(),
            as_object(self.capabilities_json()),
        );
        let mut caps = ServerCapabilities::builder()
            .enable_tools()
            .enable_resources()
            .enable_experimental()
            .build();
        caps.experimental = Some(experimental);
        ServerConfig::new(caps)
            .with_server_info(rmcp::model::Implementation::new("mcp-run", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "Use `{TOOL}` to run commands. {} The document `{RESOURCE_URI}` describes the runtime, its limits and policy.",
                self.capabilities.where_line()
            ))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let mut tools = vec![self.tool()];
        tools.extend(self.tools.iter().map(|t| self.cli_tool(t)));
        if self.runner.sessions().is_some() {
            tools.push(self.end_session_tool());
        }
        Ok(ListToolsResult::with_all_items(tools))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        if name == TOOL {
            return Some(self.tool());
        }
        if name == END_SESSION_TOOL && self.runner.sessions().is_some() {
            return Some(self.end_session_tool());
        }
        self.tools
            .iter()
            .find(|t| t.name == name)
            .map(|t| self.cli_tool(t))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        if let Some(t) = self.tools.iter().find(|t| t.name == request.name) {
            let t = t.clone();
            let r = self.run_cli_tool(&t, request.arguments, context).await;
            return Ok(self.redact_error(r).into());
        }
        if request.name == END_SESSION_TOOL && self.runner.sessions().is_some() {
            return Ok(self.end_session(request.arguments, &context).await.into());
        }
        if request.name != TOOL {
            return Err(self.redact_mcp_error(McpError::invalid_params(
                format!("unknown tool {:?}", request.name),
                None,
            )));
        }
        let r = self.run(request.arguments, context).await;
        Ok(self.redact_error(r).into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        let mut list = vec![
            Resource::new(RESOURCE_URI, "capabilities")
                .with_title("mcp-run runtime capabilities")
                .with_description("Where commands run (backend, namespace, profiles, images), the limits, the policy and the templates on offer.")
                .with_mime_type("application/json"),
        ];
        if self.runner.sessions().is_some() {
            list.push(
                Resource::new(SESSIONS_URI, "sessions")
                    .with_title("Your open mcp-run sessions")
                    .with_description("Your open sessions of run_network_tool: name, profile, calls, idle time, when each expires, where it runs.")
                    .with_mime_type("application/json"),
            );
        }
        // The caller's most recent kept outputs, on every replica.
        let caller = crate::auth::mcp_caller(&context.extensions)
            .unwrap_or_else(|| crate::auth::Caller::local("stdio"));
        let mut runs = self.kept_runs(&caller, LISTED_RUNS);
        if let Some(peers) = &self.peers {
            runs = forward::list_outputs(peers, &caller, runs, LISTED_RUNS).await;
        }
        for run in runs {
            for (i, s) in [crate::result::Stream::Stdout, crate::result::Stream::Stderr]
                .into_iter()
                .enumerate()
            {
                let name = store::stream_name(s);
                list.push(
                    Resource::new(
                        format!("mcp-run://runs/{}/{name}", run.id),
                        format!("run {} {name}", run.id),
                    )
                    .with_description(format!(
                        "The full {name} of an MCP run; {}.",
                        reply::HOW_TO_READ
                    ))
                    .with_mime_type("text/plain")
                    .with_size(run.kept[i]),
                );
            }
        }
        Ok(ListResourcesResult::with_all_items(list))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, McpError> {
        Ok(ListResourceTemplatesResult::with_all_items(vec![
            ResourceTemplate::new(resources::TEMPLATE, "run output")
                .with_title("Output of an MCP run")
                .with_description(format!(
                    "The full stdout or stderr of a run whose result names it (`id` from the result, `stream` stdout or stderr). Without parameters: the stream from its start. `bytes=A-B`: bytes A (from 0) to B (exclusive, `A-` to the end). `lines=A-B`: lines A to B (from 1, inclusive). `grep=REGEX`: the matching lines as `N:line` (with `lines`, within that range). Every read returns at most {} characters and names the next page's URI.",
                    self.config.result_chars
                ))
                .with_mime_type("text/plain"),
        ]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        if resources::is_output_uri(&request.uri) {
            return self
                .read_output(&request.uri, &context)
                .await
                .map(Into::into)
                .map_err(|e| self.redact_mcp_error(e));
        }
        if request.uri == SESSIONS_URI && self.runner.sessions().is_some() {
            let text = self
                .sessions_json(&context)
                .await
                .map_err(|e| self.redact_mcp_error(e))?;
            return Ok(
                ReadResourceResult::new(vec![ResourceContents::text(text, SESSIONS_URI)]).into(),
            );
        }
        if request.uri != RESOURCE_URI {
            return Err(self.redact_mcp_error(McpError::resource_not_found(
                format!("no resource {:?}", request.uri),
                None,
            )));
        }
        let text = serde_json::to_string_pretty(&self.capabilities_json()).unwrap_or_default();
        Ok(ReadResourceResult::new(vec![ResourceContents::text(text, RESOURCE_URI)]).into())
    }
}

#[cfg(test)]
mod tests;
