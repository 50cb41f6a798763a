// The official MCP TypeScript SDK driving mcp-run (.ci/check.d/mcp-sdks.sh).
//
// Usage: node check.mjs GATEWAY_BIN URL
// Over streamable HTTP (URL, a running gateway) and over stdio (GATEWAY_BIN stdio): a small
// command, a failing one, 10 MB of output, binary output. The SDK validates structured content
// against the output schema (Ajv); any warning it prints (such as `unknown format "uint64"`)
// fails the check. Exits 1 with the reason on the first failure.

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const BUDGET = 30000;
const [binary, url] = process.argv.slice(2);

const warnings = [];
for (const level of ["warn", "error"]) {
  const original = console[level];
  console[level] = (...args) => {
    warnings.push(args.map(String).join(" "));
    original(...args);
  };
}

function check(cond, what) {
  if (!cond) {
    console.log(`mcp-sdks (typescript): ${what}`);
    process.exit(1);
  }
}

const out = (r) => {
  check(r.structuredContent, "no structuredContent");
  return r.structuredContent.outputs[0];
};

async function exercise(transport, where) {
  const client = new Client({ name: "mcp-run-ci", version: "0" });
  await client.connect(transport);
  const { tools } = await client.listTools();
  check(tools.some((t) => t.name === "run_network_tool"), `${where}: no run_network_tool`);
  const call = (args) =>
    client.callTool({ name: "run_network_tool", arguments: args }, undefined, { timeout: 120000 });

  let r = await call({ executable: "echo", args: ["hello"] });
  check(!r.isError && out(r).stdout === "hello\n", `${where}: small ${JSON.stringify(r)}`);

  r = await call({ executable: "sh", args: ["-c", "echo boom >&2; exit 3"] });
  check(r.isError && out(r).exit_code === 3, `${where}: failing ${JSON.stringify(r)}`);

  r = await call({ executable: "sh", args: ["-c", "head -c 10485760 /dev/zero | tr '\\0' y; echo; echo END"] });
  const o = out(r);
  check(!r.isError && o.stdout.length <= BUDGET, `${where}: 10 MB result of ${o.stdout.length} chars`);
  check(o.stdout.endsWith("END\n"), `${where}: the tail of 10 MB is missing`);
  check(o.full_output.stdout_bytes === 10485765, `${where}: ${JSON.stringify(o.full_output)}`);
  const page = await client.readResource({ uri: `${o.full_output.stdout_uri}?lines=2-` });
  check(page.contents[0].text === "END\n", `${where}: lines=2- ${JSON.stringify(page)}`);

  r = await call({ executable: "sh", args: ["-c", "head -c 200000 /dev/urandom"] });
  check(!r.isError && out(r).stdout.length <= BUDGET, `${where}: binary`);

  const templates = await client.listResourceTemplates();
  check(
    templates.resourceTemplates.some((t) => t.uriTemplate.startsWith("mcp-run://runs/{id}")),
    `${where}: no output resource template`,
  );
  await client.close();
  console.log(`mcp-sdks (typescript): ${where}: ok`);
}

await exercise(new StreamableHTTPClientTransport(new URL(url)), "streamable HTTP");
await exercise(new StdioClientTransport({ command: binary, args: ["stdio"], stderr: "ignore" }), "stdio");
check(warnings.length === 0, `the SDK warned: ${warnings.join("; ")}`);
