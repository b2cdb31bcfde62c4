// Shared by the suites: a sandbox per test that is always killed, and a
// bounded wait. The gateway and its key come from the environment that
// tests/test_js_sdk.py sets (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY).
import { after } from 'node:test'
import { Sandbox } from 'e2b'

const created = []

export async function sandbox(opts = {}, SandboxClass = Sandbox) {
  const sbx = await SandboxClass.create({ timeoutMs: 120_000, ...opts })
  created.push(sbx)
  return sbx
}

// Children (forks, sandboxes made from snapshots) are killed with the rest.
export function adopt(...sandboxes) {
  created.push(...sandboxes)
  return sandboxes
}

after(async () => {
  await Promise.allSettled(created.map((s) => s.kill()))
})

export async function waitFor(what, predicate, ms = 15_000) {
  const deadline = Date.now() + ms
  for (;;) {
    const value = await predicate()
    if (value) return value
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 50))
  }
}
