// Egress policy through the JavaScript SDK. Driven by tests/test_js_sdk.py,
// which makes the "internet" (a netns test host at $INTERNET and $OTHER) and
// checks the JSON this prints.
import { Sandbox } from 'e2b'

const { INTERNET, OTHER, PORT } = process.env
const reaches = async (sbx, addr) =>
  (await sbx.commands.run(
    `curl -s -o /dev/null -w '%{http_code}' --connect-timeout 2 -m 3 http://${addr}:${PORT}/ || true`)).stdout === '200'

const open = await Sandbox.create({ timeoutMs: 120_000 })
const closed = await Sandbox.create({ timeoutMs: 120_000, allowInternetAccess: false })
const only = await Sandbox.create({ timeoutMs: 120_000, network: { allowOut: [OTHER], denyOut: ['0.0.0.0/0'] } })
try {
  const seen = {
    open: await reaches(open, INTERNET),
    closed: await reaches(closed, INTERNET),
    closedInfo: (await closed.getInfo()).allowInternetAccess,
    onlyOther: await reaches(only, OTHER),
    onlyInternet: await reaches(only, INTERNET),
  }
  await open.updateNetwork({ denyOut: [`${INTERNET}/32`] })
  seen.deniedAfterUpdate = await reaches(open, INTERNET)
  seen.otherAfterUpdate = await reaches(open, OTHER)
  await closed.updateNetwork({ allowInternetAccess: true })
  seen.reopened = await reaches(closed, INTERNET)
  console.log(JSON.stringify(seen))
} finally {
  await Promise.allSettled([open.kill(), closed.kill(), only.kill()])
}
